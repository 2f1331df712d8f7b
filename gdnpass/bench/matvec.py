"""The thin MUL_MAT at the models' product shapes (:func:`product_shapes`, read off the built and fused graph): the
copies of a weight one timing cycles through so that every launch reads it from memory (:func:`rotation`), seeded
operands, the command-line parsers of shape and column lists the mat-vec scripts share; each product against the
read-bandwidth ceiling (gdnpass.bench.ceilings), a streaming read of its bytes and cuBLAS, and the alpha/beta pair
against two single mat-vecs and its floor."""

from __future__ import annotations

import argparse
import functools
from typing import NamedTuple

import torch

from gdnpass.bench.ceilings import Ceilings, FloorRefused, read_chunks, stream_read
from gdnpass.bench.timing import kernel_us
from gdnpass.ir import DType
from gdnpass.kernels import triton_matvec as mv

# issue 32's targets: a product's share of the read bandwidth, by the bytes of its weight
BIG, MID = 32 << 20, 8 << 20
TARGET_SHARE = {BIG: 0.85, MID: 0.70}
PAIR_TARGET = 1.3  # the alpha/beta pair: at most this times (empty kernel + its bytes over the read bandwidth)


class Product(NamedTuple):
    """One product shape of a model: M rows of K, the weights' names, and whether fusion runs it as a pair."""

    M: int
    K: int
    names: str
    pair: bool


@functools.lru_cache(maxsize=None)
def product_weights(n) -> list:
    """The weights a node multiplies: a product's (``prepasses.PRODUCTS``: the weight its first source), a pair's
    two (its sources: w_a, x, w_b); none for any other node."""
    from gdnpass.ir import Op
    from gdnpass.prepasses import PRODUCTS

    if n.op.value not in PRODUCTS:
        return []
    return [n.src[0], n.src[2]] if n.op is Op.MUL_MAT_VEC_PAIR else [n.src[0]]


def product_shapes(model: str) -> tuple[Product, ...]:
    """The distinct weight products of ``model``'s verify forward as gdnpass runs it with fusion on: its first
    attention period (GDN layers and one attention layer) and the lm head, built, planned and fused on the CPU (no
    tensors). A pair's two weights are one row (their shape)."""
    from gdnpass import pipeline
    from gdnpass.ir import Op
    from gdnpass.models import VerifyConfig
    from gdnpass.models.hparams import get_model

    shape = get_model(model)
    cfg = VerifyConfig(shape.first_layers(min(shape.n_layer, shape.full_attention_interval)), 4, 3, whole=True)
    g = pipeline.run(cfg, pipeline.PassOptions(fusion=True)).graph
    found: dict[tuple, list[str]] = {}
    for n in g.nodes:
        ws = product_weights(n)
        if not ws or ws[0].base.buffer != "weights":
            continue
        key = (ws[0].ne[1], ws[0].ne[0], n.op is Op.MUL_MAT_VEC_PAIR)
        name = "+".join(w.base.name.removesuffix(".weight").split(".")[-1] for w in ws)
        if name not in found.setdefault(key, []):
            found[key].append(name)
    return tuple(Product(M, K, ", ".join(names), pair) for (M, K, pair), names in found.items())


DTYPES = {name: dtype for dtype, name in mv.WTYPES.items()}  # "bf16" -> torch.bfloat16, ...
QUANTIZED = {t.label: t for t in DType if t.is_quantized}    # "q4_k" -> DType.Q4_K, ...
WNAMES = mv.WTYPES  # torch.bfloat16 -> "bf16", ...


def rotation(nbytes: int) -> int:
    """How many copies of a weight of ``nbytes`` one timing cycles through, so that every launch reads its weight
    from memory as in a forward (which reads each of its ~16 GB of weights once): together at least twice the L2
    (H200: 50 MB), at most 256 copies. Timing one weight over and over would read one of 8-32 MB from L2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return min(256, max(1, -(-2 * l2 // nbytes)))


def operands(wt: str, M: int, K: int, N: int, seed: int = 0):
    """(w, x, y) of one product: an M x K weight of type ``wt`` (a :data:`DTYPES` name, or a block type's label: its
    bytes, :func:`quantized_weight`), N columns of x, y empty."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if wt in QUANTIZED:
        w = quantized_weight(QUANTIZED[wt], M, K, seed)
    else:
        w = (torch.randn(1, 1, M, K, device="cuda", generator=g) / 64).to(DTYPES[wt])
    x = torch.randn(1, 1, N, K, device="cuda", generator=g)
    return w, x, torch.empty(1, 1, N, M, device="cuda")


def column_counts(text: str) -> list[int]:
    """``--cols``: comma-separated column counts, 1..16."""
    try:
        v = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not all(1 <= x <= 16 for x in v):
        raise argparse.ArgumentTypeError(f"column counts are 1..16, got {text!r}")
    return v


def shape_list(text: str) -> list[tuple[int, int]]:
    """``--shapes``: ROWSxK[,ROWSxK...]."""
    try:
        return [(int(m), int(k)) for m, k in (s.split("x") for s in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxK[,ROWSxK...], e.g. 8192x4096, got {text!r}") from None


def _rotated(w: torch.Tensor) -> list[torch.Tensor]:
    return [w] + [w.clone() for _ in range(rotation(w.numel() * w.element_size()) - 1)]


def _per_launch_us(fn, launches: int) -> float:
    """Profiler kernel time of ``fn`` (one CUDA graph) over its ``launches`` products: us per product."""
    return kernel_us(fn, reps=10)[0] / launches


def read_us(nbytes: int) -> float:
    """A streaming read (gdnpass.bench.ceilings.stream_read) of ``nbytes``, cold (rotated buffers), timed as the
    products are: what reading that many bytes alone takes at this size, launch ramp and tail included."""
    n = max(1, nbytes // 4)
    xs = _rotated(torch.randn(n, device="cuda"))
    part = torch.empty(read_chunks(n, 2048, 8), device="cuda")
    return _per_launch_us(lambda: [stream_read(x, part) for x in xs], len(xs))


def target_share(weight_bytes: int) -> float | None:
    """The share of the read bandwidth a product of this weight must reach (None: no bandwidth target)."""
    return next((share for size, share in sorted(TARGET_SHARE.items(), reverse=True) if weight_bytes >= size), None)


def bench_mat_vec(models: list[str], cols: list[int], ceil: Ceilings) -> list[dict]:
    """Every product of ``models`` (:func:`product_shapes`; a pair as fusion runs it, two weights in one launch), f32
    and bf16 weights, at ``cols`` columns: the chosen tile per launch over rotated copies (each read from memory), its
    bytes over that time against the read bandwidth and its target; a streaming read of the same bytes; cuBLAS
    (``torch.mm``, bf16 x bf16 for bf16 weights) on the same rotation. Products under 8 MB of weights (alpha/beta) are
    :func:`bench_pair`'s."""
    out = []
    for model in models:
        for wt in (torch.float32, torch.bfloat16):
            for p in product_shapes(model):
                n_w = 2 if p.pair else 1
                wbytes = n_w * p.M * p.K * wt.itemsize
                if wbytes < MID:
                    continue
                ws = [_rotated((torch.randn(1, 1, p.M, p.K, device="cuda") / 64).to(wt)) for _ in range(n_w)]
                pure = read_us(wbytes)
                for n in cols:
                    x = torch.randn(1, 1, n, p.K, device="cuda")
                    ys = [torch.empty(1, 1, n, p.M, device="cuda") for _ in range(n_w)]
                    launch = (lambda v: mv.mul_mat_vec_pair(v[0], v[1], x, *ys)) if p.pair else \
                        (lambda v: mv.mul_mat_vec(v[0], x, ys[0]))
                    copies = list(zip(*ws))
                    us = _per_launch_us(lambda: [launch(v) for v in copies], len(copies))
                    xb, yb = x[0, 0].to(wt), torch.empty(n, p.M, device="cuda", dtype=wt)
                    cublas = _per_launch_us(lambda: [torch.mm(xb, w[0, 0].t(), out=yb) for v in copies for w in v],
                                            len(copies))
                    nbytes = wbytes + n * p.K * 4 + n_w * n * p.M * 4
                    row = dict(model=model, wtype=WNAMES[wt], names=p.names, pair=p.pair, M=p.M, K=p.K, cols=n,
                               bytes=nbytes, us=us, cublas_us=cublas, read_us=pure, GBps=nbytes / (us * 1e3),
                               share=nbytes / (us * 1e3) / ceil.read_GBps, target=target_share(wbytes // n_w),
                               tile=mv.mat_vec_tile(p.M, n, p.K, WNAMES[wt], n_w))
                    try:
                        row["floor_us"] = ceil.floor_us(nbytes)
                        row["met"] = row["share"] >= row["target"]
                    except FloorRefused as e:
                        row["refused"] = str(e)
                    out.append(row)
                del ws
    return out


def quantized_weight(dtype, M: int, K: int, seed: int = 0) -> torch.Tensor:
    """An M x K weight of block type ``dtype`` on the GPU, its bytes as gdnpass holds them (1, 1, M, row bytes): 64
    rows of :func:`gdnpass.kernels.quants.random_blocks`, repeated (drawing gigabytes on the CPU would dominate)."""
    from gdnpass.kernels.quants import held_rows, random_blocks

    tile = held_rows(random_blocks(min(M, 64), K, dtype, torch.Generator().manual_seed(seed), K ** -0.5), dtype).cuda()
    return tile.repeat(-(-M // tile.shape[0]), 1)[:M].reshape(1, 1, M, -1).contiguous()


def bench_quantized(model: str, cols: list[int], ceil: Ceilings) -> list[dict]:
    """Every product of ``model`` of >= 8 MB in bf16 (as :func:`bench_mat_vec`), its weights in each block type the
    mat-vec reads, at ``cols`` columns: the chosen tile per launch over rotated copies, the stored bytes (blocks +
    activations + outputs) over that time against the read bandwidth, next to the same product's bf16 time."""
    out = []
    for p in product_shapes(model):
        n_w = 2 if p.pair else 1
        if n_w * p.M * p.K * 2 < MID:
            continue
        bf16 = [_rotated((torch.randn(1, 1, p.M, p.K, device="cuda") / 64).to(torch.bfloat16)) for _ in range(n_w)]
        for dtype in (t for t in DType if t.is_quantized):
            ws = [_rotated(quantized_weight(dtype, p.M, p.K, i)) for i in range(n_w)]
            wbytes = n_w * p.M * dtype.row_bytes(p.K)
            for n in cols:
                x = torch.randn(1, 1, n, p.K, device="cuda")
                ys = [torch.empty(1, 1, n, p.M, device="cuda") for _ in range(n_w)]

                def launch(v, q=dtype):
                    if p.pair:
                        mv.mul_mat_vec_pair(v[0], v[1], x, *ys, q)
                    else:
                        mv.mul_mat_vec(v[0], x, ys[0], q)
                copies = list(zip(*ws))
                us = _per_launch_us(lambda: [launch(v) for v in copies], len(copies))
                plain = list(zip(*bf16))
                bf16_us = _per_launch_us(lambda: [launch(v, None) for v in plain], len(plain))
                nbytes = wbytes + n * p.K * 4 + n_w * n * p.M * 4
                out.append(dict(model=model, wtype=dtype.label, names=p.names, M=p.M, K=p.K, cols=n, bytes=nbytes,
                                us=us, bf16_us=bf16_us, share=nbytes / (us * 1e3) / ceil.read_GBps,
                                tile=mv.mat_vec_tile(p.M, n, p.K, dtype.label, n_w)))
            del ws
        del bf16
    return out


def bench_pair(cols: list[int], ceil: Ceilings, E: int = 4096, M: int = 32) -> list[dict]:
    """The alpha/beta pair (E 4096, M 32: qwen3.5-9b's), f32 and bf16 weights: two single mat-vec launches vs one
    pair launch, against (empty kernel + its bytes over the read bandwidth)."""
    out = []
    for wt in (torch.float32, torch.bfloat16):
        wa = (torch.randn(1, 1, M, E, device="cuda") / 64).to(wt)
        wb = (torch.randn(1, 1, M, E, device="cuda") / 64).to(wt)
        for n in cols:
            x = torch.randn(1, 1, n, E, device="cuda")
            ya, yb = torch.empty(1, 1, n, M, device="cuda"), torch.empty(1, 1, n, M, device="cuda")
            two = kernel_us(lambda: (mv.mul_mat_vec(wa, x, ya), mv.mul_mat_vec(wb, x, yb)))[0]
            pair = kernel_us(lambda: mv.mul_mat_vec_pair(wa, wb, x, ya, yb))[0]
            row = dict(wtype=WNAMES[wt], cols=n, two=two, pair=pair, ratio=pair / two)
            nbytes = 2 * M * E * wt.itemsize + n * E * 4 + 2 * n * M * 4
            try:
                row["floor_us"] = ceil.empty_us + ceil.floor_us(nbytes)
                row["met"] = pair <= PAIR_TARGET * row["floor_us"]
            except FloorRefused as e:
                row["refused"] = str(e)
            out.append(row)
    return out
