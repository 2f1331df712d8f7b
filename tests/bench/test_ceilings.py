"""The ceilings' CPU-checkable parts (gdnpass.bench.ceilings): the streaming read kernel against torch (in the Triton
interpreter), the datasheet lookup, and the cross-checks that refuse a floor. On a GPU the measurement itself runs
(marked ``gpu``)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from gdnpass.bench import ceilings as cl


@pytest.mark.parametrize("n,block,steps", [(3 * 64 * 2 + 17, 64, 2), (64 * 4, 64, 4), (5, 32, 1)])
def test_stream_read_reads_every_element_once(n, block, steps, device):
    # a read kernel that skipped a block, or read one twice, would time less (or more) than the bytes it claims
    x = torch.randn(n, device=device)
    out = torch.full((cl.read_chunks(n, block, steps),), float("nan"), device=device)
    cl.stream_read(x, out, block, steps, warps=1)
    torch.testing.assert_close(out.double(), cl.stream_read_reference(x, block, steps), rtol=1e-5, atol=1e-5)


def test_stream_read_refuses_what_it_cannot_read(device):
    with pytest.raises(ValueError, match="contiguous f32"):
        cl.stream_read(torch.zeros(8, dtype=torch.float64, device=device), torch.zeros(1, device=device))
    with pytest.raises(ValueError, match="1 partials"):
        cl.stream_read(torch.zeros(8, device=device), torch.zeros(0, device=device))


@pytest.mark.parametrize("name,want", [("NVIDIA H200", 4800), ("NVIDIA H200 NVL", 4800),
                                       ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000),
                                       ("NVIDIA H100 NVL", 3900), ("NVIDIA A10", None)])
def test_datasheet_lookup(name, want):
    assert cl.datasheet_GBps(name) == want


def _ceilings(read_events=4000.0, read_profiled=3950.0, copy_events=4100.0, copy_profiled=2550.0, sheet=4800.0):
    return cl.Ceilings("NVIDIA H200", cl.Reference("read", read_events, read_profiled, "test"),
                       cl.Reference("copy", copy_events, copy_profiled, "test"), 0.7, sheet)


def test_floor_from_an_agreeing_reference_is_bytes_over_its_events_bandwidth():
    c = _ceilings()
    assert c.problems(c.read) == []
    assert c.floor_us(4e9) == pytest.approx(1000.0)  # 4 GB at 4000 GB/s


def test_a_reference_the_tables_time_differently_is_refused():
    # the old floor's failure: a copy captured in a graph under the profiler read 1.6x slower than by events
    c = _ceilings()
    with pytest.raises(cl.FloorRefused, match=r"copy: .* 2550 GB/s, CUDA events 4100: 38% apart"):
        c.floor_us(1e9, "copy")
    assert _ceilings(read_profiled=3650.0).floor_us(4e9) == pytest.approx(1000.0)  # 9% apart: given
    with pytest.raises(cl.FloorRefused, match="12% apart"):
        _ceilings(read_profiled=3500.0).floor_us(1e9)


def test_a_reference_above_the_datasheet_is_refused_one_far_below_is_reported():
    with pytest.raises(cl.FloorRefused, match="above the datasheet"):
        _ceilings(read_events=5100.0, read_profiled=5100.0).floor_us(1e9)
    low = _ceilings(read_events=2000.0, read_profiled=2000.0)
    assert low.floor_us(2e9) == pytest.approx(1000.0)
    assert any("suspect" in r for r in low.remarks())
    assert any("not cross-checked" in r for r in _ceilings(sheet=None).remarks())


def test_report_names_every_refusal():
    lines = cl.report(_ceilings())
    assert [x for x in lines if x.startswith("REFUSED")] == [
        "REFUSED as a floor: copy: the tables' timing (profiler, CUDA graph) gives 2550 GB/s, CUDA events 4100: 38% "
        "apart (at most 10%)"]


def test_measure_refuses_a_buffer_the_l2_could_hold():
    with pytest.raises(ValueError, match=">= 1 GiB"):
        cl.measure(64 << 20)


@pytest.mark.gpu
def test_measured_ceilings_are_consistent_on_this_gpu():
    c = cl.measure()
    assert c.read.events_GBps > 0 and c.copy.events_GBps > 0
    assert c.problems(c.read) == [], cl.report(c)  # the read reference must give floors on a real card


@pytest.mark.parametrize("quantized,printed,verdict", [(False, "target <= 0.6", "0.70 MISSED"),
                                                        (True, "target <= 0.7", "0.70 MISSED")])
def test_the_whole_verify_is_judged_by_its_weights_issue(quantized, printed, verdict, capsys):
    """bench.py's ours-vs-upstream line holds a quantized file to issue 34's <= 0.7 of upstream's kernel time and a
    plain one to issue 32's <= 0.6 (a Q8_0 file at 0.70 was printed against 0.6 once); 0.7026 misses both."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
    spec = importlib.util.spec_from_file_location("bench_script", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    side = {"kernels": 465, "kernel_us": 5615.0, "us_per_forward": 5906.0, "weight_bytes": 8.44e9}
    whole = [{"T": 4, "rows": 4, "gdn_layers": 24, "off": {**side, "kernels": 1222}, "on": side}]
    up = {"model": "qwen3.5-9b", "cases": [{"T": 4, "rows": 4, "kernels": 1172, "kernel_us": 7992.0,
                                            "wall_us": 6131.0}]}
    bench.print_versus(whole, up, _ceilings(read_events=3148.0, read_profiled=3226.0, sheet=3350.0), quantized)
    out = capsys.readouterr().out
    assert printed in out and verdict in out, out
    assert ("(target <= 0.65)" in out) is not quantized, out  # (issue 34 states no wall target)
