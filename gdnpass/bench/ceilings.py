"""The ceilings every floor is held against: how fast the card in use reads and copies memory.

A floor is bytes over a bandwidth, so a wrong bandwidth makes every floor wrong. Measured here the way a ceiling must
be measured (``../shared`` METHOD.md; issue 32):

- **read bandwidth**: a streaming read of 1 GiB (:func:`stream_read`, a few launch shapes, and ``torch.sum``; the
  fastest is the ceiling), **copy bandwidth**: a 1 GiB device copy, bytes read + written; each timed with CUDA events
  around the calls, outside any CUDA-graph capture and any profiler (:func:`gdnpass.bench.timing.events_us`);
- **cross-checked against the datasheet** (:data:`DATASHEET_GBps`): a measurement above it is impossible (the bytes
  came from a cache) and refuses the floors; one far below it is reported;
- **cross-checked against the tables' own timing**: the benchmarks time kernels as profiler durations of a captured
  CUDA graph (:func:`~gdnpass.bench.timing.kernel_us`). The same 1 GiB read and copy are timed that way too; where
  that disagrees with the events by more than :data:`AGREEMENT`, a floor from that reference is refused
  (:class:`FloorRefused`) rather than printed. This is the check that the old floor lacked: ``b.copy_(a)`` captured in
  a graph becomes a memcpy node, and under the profiler it ran 1.6x slower than the same copy timed with events, so
  the old "copy bandwidth" was 2.55 TB/s on an H200 that reads at 4.0.

The read kernel runs in the Triton interpreter too (tests/bench/test_ceilings.py checks it against torch); timing
needs a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

GIB = 1 << 30
AGREEMENT = 0.10  # the most a reference's two timings may differ by before a floor from it is refused

# The memory bandwidth the vendor's datasheet gives, GB/s (decimal), by torch.cuda.get_device_name(); the longest
# matching name wins. NVIDIA H100 / H200 datasheets: SXM5 80 GB HBM3 3.35 TB/s, PCIe 80 GB 2.0 TB/s, NVL 94 GB
# 3.9 TB/s; H200 (SXM and NVL) 141 GB HBM3e 4.8 TB/s.
DATASHEET_GBps = {"H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900, "H200": 4800}
PLAUSIBLE = 0.6  # a measurement under this share of the datasheet is reported as suspect (throttled, shared card)

# (BLOCK, STEPS, warps) of the streaming read: the ceiling is the fastest of these and torch.sum
READ_SHAPES = ((2048, 8, 4), (4096, 4, 8), (1024, 16, 4))


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """out[p] = the sum of x's chunk p (STEPS blocks of BLOCK f32): every byte of x read once, one f32 written per
    chunk. The steps are unrolled so each thread has all its loads in flight before the first add."""
    base = tl.program_id(0).to(tl.int64) * (BLOCK * STEPS)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(STEPS):
        i = base + s * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_chunks(n: int, block: int, steps: int) -> int:
    """How many partial sums :func:`stream_read` writes for ``n`` elements."""
    return triton.cdiv(n, block * steps)


def stream_read(x: torch.Tensor, out: torch.Tensor, block: int = 2048, steps: int = 8, warps: int = 4) -> None:
    """out[p] = sum of x[p * block * steps : (p + 1) * block * steps] (x flat f32, out ``read_chunks`` f32)."""
    n = x.numel()
    if x.dtype != torch.float32 or not x.is_contiguous() or out.numel() < read_chunks(n, block, steps):
        raise ValueError(f"stream_read: a contiguous f32 x and {read_chunks(n, block, steps)} partials")
    _stream_read_kernel[(read_chunks(n, block, steps),)](x, out, n, BLOCK=block, STEPS=steps, num_warps=warps)


def stream_read_reference(x: torch.Tensor, block: int = 2048, steps: int = 8) -> torch.Tensor:
    """torch's :func:`stream_read`: the chunk sums, in float64."""
    chunk = block * steps
    pad = torch.zeros(read_chunks(x.numel(), block, steps) * chunk, dtype=torch.float64, device=x.device)
    pad[:x.numel()] = x.flatten().double()
    return pad.view(-1, chunk).sum(1)


class FloorRefused(Exception):
    """A floor asked of a reference that failed its cross-checks; the message says which check and by how much."""


@dataclass(frozen=True)
class Reference:
    """One bandwidth, GB/s, as the events time it (the ceiling) and as the tables' method times the same work."""

    name: str
    events_GBps: float
    profiled_GBps: float
    how: str  # what was timed

    @property
    def disagreement(self) -> float:
        return abs(self.profiled_GBps / self.events_GBps - 1)


@dataclass(frozen=True)
class Ceilings:
    """The card's ceilings (:func:`measure`) and the floors they give; ``problems`` names each failed cross-check."""

    gpu: str
    read: Reference
    copy: Reference
    empty_us: float
    datasheet_GBps: float | None
    read_variants: dict = field(default_factory=dict)  # every read timed: label -> GB/s (events)

    def problems(self, ref: Reference) -> list[str]:
        """Why ``ref`` may not give floors (empty: it may)."""
        p = []
        if ref.disagreement > AGREEMENT:
            p.append(f"{ref.name}: the tables' timing (profiler, CUDA graph) gives {ref.profiled_GBps:.0f} GB/s, "
                     f"CUDA events {ref.events_GBps:.0f}: {ref.disagreement:.0%} apart (at most {AGREEMENT:.0%})")
        if self.datasheet_GBps and ref.events_GBps > 1.02 * self.datasheet_GBps:
            p.append(f"{ref.name}: {ref.events_GBps:.0f} GB/s is above the datasheet's {self.datasheet_GBps:.0f} "
                     "(the bytes came from a cache)")
        return p

    def remarks(self) -> list[str]:
        """Cross-checks that do not refuse a floor but a reader should see."""
        if self.datasheet_GBps is None:
            return [f"no datasheet bandwidth for {self.gpu!r} (DATASHEET_GBps): not cross-checked"]
        return [f"{r.name} {r.events_GBps:.0f} GB/s is {r.events_GBps / self.datasheet_GBps:.0%} of the datasheet's "
                f"{self.datasheet_GBps:.0f}" + (" (suspect: a throttled or shared card?)"
                                                if r.events_GBps < PLAUSIBLE * self.datasheet_GBps else "")
                for r in (self.read, self.copy)]

    def floor_us(self, nbytes: float, ref: str = "read") -> float:
        """The time ``nbytes`` take at the ``ref`` bandwidth ("read" or "copy"), us; :class:`FloorRefused` when that
        reference failed a cross-check."""
        r = self.read if ref == "read" else self.copy
        p = self.problems(r)
        if p:
            raise FloorRefused("; ".join(p))
        return nbytes / (r.events_GBps * 1e3)

    @property
    def read_GBps(self) -> float:
        return self.read.events_GBps


def datasheet_GBps(gpu: str) -> float | None:
    """:data:`DATASHEET_GBps` of the longest key in ``gpu``'s name, or None."""
    keys = [k for k in DATASHEET_GBps if k in gpu]
    return DATASHEET_GBps[max(keys, key=len)] if keys else None


@triton.jit
def _empty_kernel(x_ptr):
    pass


def empty_us() -> float:
    """An empty Triton kernel's duration (profiler, CUDA graph): what any launch costs before its first byte."""
    from gdnpass.bench.timing import kernel_us

    x = torch.empty(1, device="cuda")
    return kernel_us(lambda: _empty_kernel[(1,)](x))[0]


def measure(nbytes: int = GIB) -> Ceilings:
    """The card's :class:`Ceilings`: reads and a copy of ``nbytes`` (>= 1 GiB: twenty times the H200's L2), an empty
    Triton kernel (profiler)."""
    from gdnpass.bench.timing import events_us, kernel_us

    if nbytes < GIB:
        raise ValueError(f"ceilings: {nbytes} bytes would be read partly from the L2; use >= 1 GiB")
    n = nbytes // 4
    x = torch.randn(n, device="cuda")
    gb = n * 4 / 1e3  # bytes / 1e3: GB/s from us
    variants, profiled = {}, {}
    for block, steps, warps in READ_SHAPES:
        part = torch.empty(read_chunks(n, block, steps), device="cuda")
        fn = (lambda part=part, b=block, s=steps, w=warps: stream_read(x, part, b, s, w))
        label = f"Triton read {block}x{steps}, {warps} warps"
        variants[label] = gb / events_us(fn)
        profiled[label] = gb / kernel_us(fn, reps=10)[0]
    total = torch.empty((), device="cuda")
    variants["torch.sum"] = gb / events_us(lambda: torch.sum(x, 0, out=total))
    profiled["torch.sum"] = gb / kernel_us(lambda: torch.sum(x, 0, out=total), reps=10)[0]
    best = max(variants, key=variants.get)
    read = Reference("read", variants[best], profiled[best], f"{best}, {nbytes / GIB:g} GiB")
    y = torch.empty_like(x)
    copy = Reference("copy", 2 * gb / events_us(lambda: y.copy_(x)), 2 * gb / kernel_us(lambda: y.copy_(x), reps=10)[0],
                     f"y.copy_(x), {nbytes / GIB:g} GiB read + written")
    gpu = torch.cuda.get_device_name()
    return Ceilings(gpu, read, copy, empty_us(), datasheet_GBps(gpu), variants)


def report(c: Ceilings) -> list[str]:
    """The ceilings as lines for bench.py: each reference, both timings, its cross-checks."""
    out = [f"empty Triton kernel {c.empty_us:.2f} us (profiler, CUDA graph)"]
    for r in (c.read, c.copy):
        out.append(f"{r.name} bandwidth {r.events_GBps:.0f} GB/s by CUDA events ({r.how}); the tables' timing of the "
                   f"same: {r.profiled_GBps:.0f} GB/s ({r.disagreement:.0%} apart)")
    out.append("reads timed: " + "; ".join(f"{k} {v:.0f}" for k, v in c.read_variants.items()))
    out += c.remarks()
    for r in (c.read, c.copy):
        out += [f"REFUSED as a floor: {p}" for p in c.problems(r)]
    return out
