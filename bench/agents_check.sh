#!/usr/bin/env bash
# The real coding agents against a real `spark-run --serve` on tiny models of every arch (see
# bench/agents_check.py for what is run and checked). Installs the pinned clients (npm, PyPI) into
# $AGENTS_CHECK_CACHE (reused by later runs) or a temporary folder, then runs the check; extra
# arguments go to agents_check.py (--only codex,aider, --archs laguna, --record DIR, --out DIR).
#
#   bash bench/agents_check.sh                     # from the repo root, in its venv
#   AGENTS_CHECK_CACHE=~/.cache/sparkpack-agents bash bench/agents_check.sh --only codex
#
# Needs node/npm (20+) and network access to the npm registry and PyPI for the first install.
# Not part of the test suite.
set -euo pipefail

CLAUDE_CODE_VERSIONS=(2.1.332 2.1.197)  # the newest, and an older 2.1 whose requests differ (see README)
CODEX_VERSION=0.171.0
OPENCODE_VERSION=1.18.33
AIDER_VERSION=0.86.2

root=${AGENTS_CHECK_CACHE:-$(mktemp -d -t agents-check-clients.XXXXXX)}
mkdir -p "$root"
root=$(cd "$root" && pwd)
export AGENTS_CHECK_CACHE=$root

npm_install() {  # folder package@version: once per version
    local dir=$root/$1 spec=$2
    if [[ $(cat "$dir/.installed" 2>/dev/null) != "$spec" ]]; then
        echo "installing $spec into $dir" >&2
        rm -rf "$dir" && mkdir -p "$dir"
        npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "$spec" >&2
        echo "$spec" > "$dir/.installed"
    fi
}

for v in "${CLAUDE_CODE_VERSIONS[@]}"; do
    npm_install "claude-code-$v" "@anthropic-ai/claude-code@$v"
done
npm_install codex "@openai/codex@$CODEX_VERSION"
npm_install opencode "opencode-ai@$OPENCODE_VERSION"
if [[ $(cat "$root/aider/.installed" 2>/dev/null) != "aider-chat==$AIDER_VERSION" ]]; then
    echo "installing aider-chat==$AIDER_VERSION into $root/aider" >&2
    rm -rf "$root/aider"
    python3 -m venv "$root/aider"
    "$root/aider/bin/pip" install -q "aider-chat==$AIDER_VERSION" >&2
    echo "aider-chat==$AIDER_VERSION" > "$root/aider/.installed"
fi

versions=$(IFS=,; echo "${CLAUDE_CODE_VERSIONS[*]}")
exec python "$(dirname "$0")/agents_check.py" --clients "$root" --claude-versions "$versions" "$@"
