"""scripts/bench_fp8_wgrad.py on the CPU: a block's four weight gradients at the depth's widths (worked out
here by hand), and errors against float64 that show the FP8 formats' rounding next to bf16's."""

import json
import subprocess
import sys

from tests.train_helpers import ROOT


def test_rows_name_the_blocks_products_with_fp8_rounding(tmp_path):
    out = tmp_path / "wgrad.json"
    cmd = [
        sys.executable,
        "scripts/bench_fp8_wgrad.py",
        "--depths",
        "2",
        "3",
        "--tokens",
        "256",
        "--repeats",
        "1",
    ]
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # Width aspect_ratio 64 x depth rounded up to head_dim 128: 128 at depth 2, 256 at depth 3.
    want = {}
    for depth, c in ((2, 128), (3, 256)):
        want |= {(depth, "mlp_w1"): [4 * c, c], (depth, "mlp_w2"): [c, 4 * c], (depth, "qkv"): [3 * c, c]}
        want[depth, "proj"] = [c, c]
    assert {(r["depth"], r["product"]): r["shape"] for r in rows} == want
    for r in rows:
        assert r["tokens"] == 256
        assert r["rel_err_bf16"] < 0.005, r
        # e5m2 (two mantissa bits) times e4m3 (three): a few percent on normal operands, far above bf16.
        assert 0.03 < r["rel_err_fp8"] < 0.1, r
        assert min(r["bf16_us"], r["fp8_us"], r["fp8_quantise_us"], r["fp8_product_us"]) > 0
    assert str(out) in proc.stdout


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    out = tmp_path / "wgrad.json"
    cmd = [sys.executable, "scripts/bench_fp8_wgrad.py", "--tokens", "8", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--tokens at least 16" in proc.stderr
    assert not out.exists()
