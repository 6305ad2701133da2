"""Programmatic dependent launch (PDL): the next kernel of a stream starts while this one drains.

Why: a one-token decode step is ~500 small kernels in a row (12 a layer on the 48-layer
Qwen3-30B shape), most of them a few microseconds long, and each one's launch, ramp-up and
memory latency otherwise starts only after the previous kernel has fully retired. On Hopper a
kernel launched with PDL may become resident as soon as every program of its predecessor has
signalled (``griddepcontrol.launch_dependents``), and blocks in ``griddepcontrol.wait`` until
that predecessor has completed and its writes are visible.

The rule that keeps this exact, for every kernel of the runtime: ``wait_prior(PDL)`` comes
before any load or store, in every program. So a kernel touches nothing its predecessor writes
or reads before that predecessor is done (no read-after-write or write-after-read race), and
since each predecessor itself waited for its own, completion is transitive down the stream.
Only two things may come first: ``prefetch_l2``, a hint to bring weights or older KV rows into
L2, which loads nothing into the program and so cannot race; and reads of what no kernel writes
during a step (the decode position, set before it). A kernel signals its dependents only after
its wait, so at most two kernels share the GPU and a kernel's successor fills slots its own
programs left free (it cannot starve it). Results never depend on PDL: ``SPARKPACK_PDL=0`` turns
it off (a CUDA test compares both).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3 on NVIDIA; without it, PDL is simply off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to complete, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(lo, hi, PDL: tl.constexpr):
    """Before ``wait_prior``: ask for the bytes from pointer ``lo`` up to pointer ``hi`` to be
    brought into L2 (Hopper's bulk prefetch, one instruction, no registers held), for data no
    kernel of the step writes (weights, older KV rows). The DRAM latency then overlaps the
    predecessor's tail instead of following it. A hint only: it never changes a result. The range
    is rounded out to 16-byte units, which stays inside the allocation (sizes are rounded to 512)."""
    if PDL:
        a = lo.to(tl.int64, bitcast=True)
        start = a // 16 * 16  # the instruction wants 16-byte units
        size = (hi.to(tl.int64, bitcast=True) - start + 15) // 16 * 16
        if size > 0:
            addr = tl.full([1], 0, tl.int64) + start
            nbytes = tl.full([1], 0, tl.int32) + size.to(tl.int32)
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                      [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _supported(index: int) -> bool:
    return (os.environ.get("SPARKPACK_PDL", "1") != "0" and gdc_wait is not None
            and torch.cuda.get_device_capability(index)[0] >= 9)


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with PDL (Hopper or newer, not turned off)."""
    return t.is_cuda and _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())


def flags(t: torch.Tensor) -> dict[str, bool]:
    """Launch keywords of a runtime kernel whose tensors live on ``t``'s device: its ``PDL``
    constexpr (which compiles ``wait_prior`` in) and Triton's ``launch_pdl`` attribute, together."""
    on = enabled(t)
    return {"PDL": on, "launch_pdl": on}


def reset() -> None:
    """Re-read ``SPARKPACK_PDL`` (tests switch it within one process)."""
    _supported.cache_clear()
