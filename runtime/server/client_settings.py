"""What to paste into the coding agents so they use the server and stay inside its context
(README "Use it from your agent" explains each; ``bench/agents_check.py`` runs the real clients
with exactly these).

Claude Code assumes a large window for a model name it does not know and then never compacts
before the server's ``--ctx``. ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` sets the window its
auto-compaction counts in, but Claude Code raises any value under ``CLAUDE_CODE_MIN_WINDOW`` to
it; its threshold is that window less the output it reserves (its max output, at most
``CLAUDE_CODE_OUTPUT_RESERVE``) and a buffer, or ``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` percent of
the window less the reserve when that is lower. The percentage is chosen so that the threshold
falls at ``COMPACT_AT`` of ``--ctx`` (read in Claude Code 2.1.197 to 2.1.332; agents_check proves
it with the real client).
"""
from __future__ import annotations

COMPACT_AT = 0.85  # compact at this share of --ctx (Codex gets the same limit)
CLAUDE_CODE_MIN_WINDOW = 100_000
CLAUDE_CODE_OUTPUT_RESERVE = 20_000


def claude_code_compaction(ctx: int) -> dict[str, str]:
    """The two variables that make Claude Code compact before ``ctx`` tokens."""
    window = max(ctx, CLAUDE_CODE_MIN_WINDOW)  # (a smaller one is raised with a warning)
    pct = max(1, min(100, int(100 * COMPACT_AT * ctx) // (window - CLAUDE_CODE_OUTPUT_RESERVE)))
    return {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(window), "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": str(pct)}


def claude_code_env(name: str, ctx: int) -> dict[str, str]:
    """Claude Code's variables besides its URL and key: every tier mapped to the served model, no
    per-request attribution block (it would change the prompt's first tokens every request), and
    compaction inside ``ctx``."""
    return {"ANTHROPIC_MODEL": name, "ANTHROPIC_DEFAULT_OPUS_MODEL": name, "ANTHROPIC_DEFAULT_SONNET_MODEL": name,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": name, "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
            **claude_code_compaction(ctx)}


def codex_config(name: str, base: str, ctx: int) -> str:
    """Codex CLI's ``~/.codex/config.toml``."""
    return "\n".join([
        f'model = "{name}"',
        'model_provider = "sparkpack"',
        f"model_context_window = {ctx}",
        f"model_auto_compact_token_limit = {int(ctx * COMPACT_AT)}",
        "[model_providers.sparkpack]",
        'name = "sparkpack"',
        f'base_url = "{base}/v1"',
        'wire_api = "responses"',
        'env_key = "OPENAI_API_KEY"',
        "",
    ])


def client_settings(name: str, base: str, ctx: int, api_key: str | None) -> str:
    """What ``spark-run --serve`` prints once loaded."""
    key = api_key if api_key is not None else "sparkpack"
    claude = " ".join(f"{k}={v}" for k, v in {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_AUTH_TOKEN": key,
                                              **claude_code_env(name, ctx)}.items())
    return "\n".join([
        f"sparkpack: serving {name} at {base} (context {ctx} tokens); Ctrl-C stops it",
        "",
        "  OpenAI clients (Aider, OpenCode, Continue, the openai SDK):",
        f"    export OPENAI_BASE_URL={base}/v1 OPENAI_API_KEY={key}",
        "  Claude Code (and the anthropic SDK):",
        f"    export {claude}",
        "  Codex CLI (~/.codex/config.toml):",
        *("    " + line for line in codex_config(name, base, ctx).splitlines()),
        "",
    ])
