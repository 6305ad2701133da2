"""repack export --llama-cpp: the -ot regexes select exactly the intended expert tensors of a
synthetic GGUF (in Python's re and, where a C++ compiler is at hand, in std::regex as llama.cpp
applies it), the budget follows llama.cpp's arithmetic, and the CLI prints paste-ready arguments."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sparkpack.formats.archs import model_spec
from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.formats.profile import Profile, model_identity
from sparkpack.repack.cli import cli
from sparkpack.repack.llama_cpp_args import (EXPS_REGEX, kv_cache_bytes, layer_pattern, override_matches,
                                             plan_llama_cpp)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> Path:
    """A tiny qwen3moe with 13 layers, so block 1 and blocks 10-12 share a leading digit."""
    from sparkpack.repack.synth import get_preset, write_synthetic

    p = get_preset("qwen3moe", "tiny")
    p = replace(p, name="deep", n_layer=13, n_head=p.n_head[:1] * 13)
    return write_synthetic(tmp_path_factory.mktemp("deep") / "deep.gguf", "qwen3moe", p, "Q8_0", skew="reference")


def expert_names(spec, layers) -> set[str]:
    return {n for il in layers for n in spec.expert_tensors[il].values()}


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe", "laguna"])
def test_patterns_select_exactly_the_layers_expert_tensors(arch, synth_model, deep):
    gguf = GGUFModel(deep if arch == "qwen3moe" else synth_model(arch))
    spec = model_spec(gguf)
    names = list(gguf.tensors)
    moe = spec.moe_layers
    rng = np.random.default_rng(0)
    for cpu in ([moe[0]], [moe[1]], moe[:2], moe, sorted(rng.choice(moe, size=len(moe) // 2, replace=False).tolist())):
        got = override_matches(f"{layer_pattern(cpu)}=CPU", names)
        assert set(got) == expert_names(spec, cpu), cpu
        assert set(got.values()) == {"CPU"}
    # llama.cpp's own --n-cpu-moe N patterns take the experts of the first N blocks
    n = 3
    value = ",".join(f"blk\\.{i}{EXPS_REGEX}=CPU" for i in range(n))
    assert set(override_matches(value, names)) == expert_names(spec, [il for il in moe if il < n])


def test_first_matching_pattern_wins():
    names = ["blk.1.ffn_up_exps.weight", "blk.12.ffn_up_exps.weight"]
    got = override_matches(f"{layer_pattern([1])}=CUDA0,{layer_pattern([1, 12])}=CPU", names)
    assert got == {"blk.1.ffn_up_exps.weight": "CUDA0", "blk.12.ffn_up_exps.weight": "CPU"}


CPP = r"""
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>
// llama.cpp's -ot handling: split the value at ',' then at the first '=' (common/arg.cpp), and
// give each tensor the buffer type of the first pattern that std::regex_search finds in its
// name (llama-model-loader.cpp). argv[1]: the -ot value; stdin: tensor names.
int main(int argc, char ** argv) {
    std::vector<std::pair<std::regex, std::string>> rules;
    std::stringstream ss(argv[1]);
    std::string item;
    while (std::getline(ss, item, ',')) {
        auto pos = item.find('=');
        rules.emplace_back(std::regex(item.substr(0, pos)), item.substr(pos + 1));
    }
    std::string name;
    while (std::getline(std::cin, name)) {
        for (auto & r : rules) {
            if (std::regex_search(name, r.first)) { std::cout << name << '=' << r.second << '\n'; break; }
        }
    }
}
"""


@pytest.mark.slow
def test_std_regex_agrees(deep, tmp_path):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to run std::regex (the ECMAScript engine llama.cpp matches with)")
    src, exe = tmp_path / "ot.cpp", tmp_path / "ot"
    src.write_text(CPP)
    subprocess.run([cxx, "-std=c++17", "-O0", str(src), "-o", str(exe)], check=True, capture_output=True)
    gguf = GGUFModel(deep)
    spec = model_spec(gguf)
    names = list(gguf.tensors)
    for cpu in ([1], [1, 10, 12], spec.moe_layers):
        value = f"{layer_pattern(cpu)}=CPU"
        out = subprocess.run([str(exe), value], input="\n".join(names) + "\n", capture_output=True, text=True,
                             check=True).stdout
        assert dict(line.split("=") for line in out.split()) == override_matches(value, names)


def test_kv_cache_follows_llama_cpp(synth_model):
    spec = model_spec(GGUFModel(synth_model("qwen3moe")))
    row = spec.n_head_kv[0] * spec.head_dim * 2  # F16
    assert kv_cache_bytes(spec, 1000) == 2 * 1024 * row * spec.n_layer  # n_ctx padded to 256
    assert kv_cache_bytes(spec, 1000, "q8_0") == 2 * 1024 * spec.n_layer * spec.n_head_kv[0] * spec.head_dim // 32 * 34
    lag = model_spec(GGUFModel(synth_model("laguna")))
    window = lag.sliding_window
    swa_cells = -(-(window + 512) // 256) * 256
    full = [il for il, k in enumerate(lag.layers) if k.attention == "full"]
    swa = [il for il, k in enumerate(lag.layers) if k.attention == "sliding"]
    expect = sum(2 * 8192 * lag.n_head_kv[il] * lag.head_dim * 2 for il in full) + \
        sum(2 * swa_cells * lag.n_head_kv[il] * lag.head_dim * 2 for il in swa)
    assert full and swa and kv_cache_bytes(lag, 8192) == expect
    q35 = model_spec(GGUFModel(synth_model("qwen35moe")))
    attn = [il for il, k in enumerate(q35.layers) if k.attention == "full"]
    d = q35.deltanet
    state = (d.conv_kernel - 1) * (d.inner + 2 * d.n_k * d.d_k) + d.d_k * d.inner  # llama.cpp's n_embd_r + n_embd_s, F32
    n_linear = sum(k.attention == "linear" for k in q35.layers)
    assert kv_cache_bytes(q35, 256) == sum(2 * 256 * q35.n_head_kv[il] * q35.head_dim * 2 for il in attn) + \
        n_linear * state * 4


def test_budget_keeps_the_smallest_layers_and_counts_what_llama_cpp_puts_on_the_gpu(synth_model):
    spec = model_spec(GGUFModel(synth_model("qwen3moe")))
    moe = spec.moe_layers
    tensors = {"token_embd.weight": 10_000, "output.weight": 500, "output_norm.weight": 4}
    for il in range(spec.n_layer):
        tensors[f"blk.{il}.attn_q.weight"] = 100
        for role, name in spec.expert_tensors.get(il, {}).items():
            tensors[name] = 1000 if il != moe[-1] else 1500  # the last MoE layer is larger (a Q6_K down)
    other = 500 + 4 + 100 * spec.n_layer
    kv = kv_cache_bytes(spec, 256)
    roles = len(spec.expert_tensors[moe[0]])
    budget = other + kv + 2 * 1000 * roles + 999  # two small layers fit, not a third
    plan = plan_llama_cpp(tensors, spec, budget, 256, reserve=0)
    assert plan.gpu_weights == other  # token_embd stays in host memory
    assert plan.gpu_layers == sorted(moe[:-1][-2:]) and moe[-1] in plan.cpu_layers  # later small ones first
    assert plan.gpu_bytes <= budget < plan.gpu_bytes + 1000 * roles
    # --n-cpu-moe must keep the large last layer on the GPU, so it fits one layer fewer
    assert plan.n_cpu_moe == moe[-1] and len(plan.n_cpu_moe_layers) == len(plan.cpu_layers) + 1
    tied = {k: v for k, v in tensors.items() if k != "output.weight"}
    assert plan_llama_cpp(tied, spec, budget, 256, reserve=0).gpu_weights == other - 500 + 10_000


def test_n_cpu_moe_is_the_prefix_that_fits(synth_model):
    spec = model_spec(GGUFModel(synth_model("qwen3moe")))
    tensors = {n: 1000 for il in spec.moe_layers for n in spec.expert_tensors[il].values()}
    per_layer = 1000 * len(spec.expert_tensors[spec.moe_layers[0]])
    kv = kv_cache_bytes(spec, 256)
    plan = plan_llama_cpp(tensors, spec, kv + 2 * per_layer, 256, reserve=0)
    assert plan.n_cpu_moe == spec.moe_layers[-3] + 1 and len(plan.n_cpu_moe_layers) == len(plan.cpu_layers)


def export(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkpack.repack.cli", "export", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_cli_prints_paste_ready_arguments_and_rates(synth_model, tmp_path):
    model = tmp_path / "tiny.gguf"
    model.write_bytes(synth_model("qwen3moe", skew="reference").read_bytes())
    gguf = GGUFModel(model)
    spec = model_spec(gguf)
    prof = Profile.new(model_identity(gguf), spec)
    prof.add(generated=np.ones((spec.n_layer, spec.n_expert)) * np.arange(spec.n_expert) ** 2, generated_tokens=100)
    prof.save(tmp_path / "tiny.profile.json")
    fits_two = ["--vram", "5MiB", "--reserve", "0", "--ctx", "256"]  # 1.4 MiB other, 0.5 MiB KV, 1.2 MiB a layer
    d = json.loads(CliRunner().invoke(cli, ["export", str(model), "--llama-cpp", *fits_two, "--json"],
                                      catch_exceptions=False).output)
    assert len(d["cpu_layers"]) == len(d["gpu_layers"]) == 2 and d["gpu_bytes"] <= d["vram"]
    n_moe = len(spec.moe_layers)
    assert d["expected_cold_hit_rate"]["generated"] == pytest.approx(len(d["cpu_layers"]) / n_moe)
    assert d["per_expert_cold_hit_rate"]["generated"] < d["expected_cold_hit_rate"]["generated"]
    res = export(model, "--llama-cpp", *fits_two)
    assert res.returncode == 0, res.stderr
    args = shlex.split(res.stdout)
    assert args == d["args"] and args[args.index("-ot") + 1].endswith("=CPU")
    assert re.search(r"\d of \d MoE layers keep their experts on the GPU", res.stderr)

    for bad, message in ((["--vram", "1GiB"], "too small for llama.cpp"), (["--vram", "2GiB", "--reserve", "x"], "size"),
                         ([], "Missing option")):
        r = export(model, "--llama-cpp", *bad)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and message in lines[0], r.stderr
    r = export(model, "--vram", "2GiB")
    assert r.returncode == 1 and "--llama-cpp" in r.stderr
    other = synth_model("qwen3moe", skew="reference", seed=2)
    r = export(other, "--llama-cpp", "--vram", "2GiB", "--profile", tmp_path / "tiny.profile.json")
    assert r.returncode == 1 and "profile is for another model" in r.stderr


def test_llama_cpp_places_what_the_export_says(synth_model, tmp_path):
    """The referee: llama.cpp itself loads a tiny model with the exported arguments. Its debug log
    names every tensor an override sent to the CPU, and its KV / recurrent-state sizes must be
    ours; on a CUDA build its GPU model buffer must be the weights we counted there. Needs a
    llama.cpp ``llama-completion`` (or ``llama-cli``) binary in SPARKPACK_LLAMA_CLI."""
    exe = os.environ.get("SPARKPACK_LLAMA_CLI")
    if not exe:
        pytest.skip("SPARKPACK_LLAMA_CLI is not set (path to a llama.cpp llama-completion binary); the patterns "
                    "are still checked in Python re and std::regex above")
    mib = 1024 * 1024
    for arch in ("qwen3moe", "qwen35moe", "laguna"):
        path = synth_model(arch, skew="reference")
        gguf = GGUFModel(path)
        spec = model_spec(gguf)
        tensors = {n: t.nbytes for n, t in gguf.tensors.items()}
        probe = plan_llama_cpp(tensors, spec, 1 << 40, 1000, reserve=0)
        two = probe.gpu_weights + probe.kv + sum(sorted(probe.expert_layer_bytes.values())[:2])
        plan = plan_llama_cpp(tensors, spec, two, 1000, reserve=0)
        assert len(plan.gpu_layers) == 2 and plan.cpu_layers
        out = subprocess.run([exe, "-m", str(path), *plan.args(), "-fit", "off", "-n", "1", "-p", "hi", "-no-cnv",
                              "--verbose"], capture_output=True, text=True, timeout=300)
        log = out.stdout + out.stderr
        assert out.returncode == 0, log[-2000:]
        moved = set(re.findall(r"tensor (\S+) \(.*\) buffer type overridden to CPU", log))
        assert moved == expert_names(spec, plan.cpu_layers), arch
        sizes = [float(x) for x in re.findall(r"(?:llama_kv_cache|llama_memory_recurrent): size = +([\d.]+) MiB", log)]
        assert sizes and abs(sum(sizes) - plan.kv / mib) <= 0.006 * len(sizes), (arch, sizes, plan.kv / mib)
        gpu = re.findall(r"CUDA0 model buffer size = +([\d.]+) MiB", log)
        if gpu:
            on_gpu = plan.gpu_weights + sum(plan.expert_layer_bytes[il] for il in plan.gpu_layers)
            assert abs(float(gpu[-1]) - on_gpu / mib) <= 0.05, (arch, gpu, on_gpu / mib)
