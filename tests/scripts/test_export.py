"""scripts/export.py, generate.py and eval.py as a user runs them, on a tiny run trained by train.py, each
checked against what the checkpoint itself gives: its weights (run.checkpoint.read_model_state), the model
built from them, eval/sample.py's generate and eval/loss.py's evaluate."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from omegaconf import OmegaConf

from configs.data_schema import DataConfig
from data import PackedLoader, prepare
from data import tokenizer as tok
from eval.loss import evaluate, token_bytes
from eval.sample import generate
from model.export import ExportInvalid, load_export, read_metadata
from model.gpt import GPT
from run.checkpoint import read_model_state
from run.dist import DistInfo
from tests.train_helpers import ROOT, metrics, run_train, small_run

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def script(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"scripts/{name}", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def checkpoint(run_dir, step: int):
    return run_dir / "checkpoints" / f"step_{step:06d}"


def manifest_of(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def data_config(path):
    return OmegaConf.merge(OmegaConf.structured(DataConfig), manifest_of(path)["config"]["data"])


def run_data(path):
    """The prepared data of the checkpoint's run, found from its manifest alone."""
    return prepare(data_config(path), build=False)


def checkpoint_model(path) -> GPT:
    """The trained model rebuilt from the checkpoint, by train.py's own constructor, on the CPU."""
    manifest = manifest_of(path)
    config = manifest["config"]
    model = GPT(
        OmegaConf.create(config["model"]),
        manifest["shape"]["vocab_size"],
        "reference",
        config["data"]["max_seqlen"],
    )
    model.load_state_dict(read_model_state(path), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A 12-step run keeping its checkpoints of steps 8 and 12."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    run_train(small_run(corpus, run_dir))
    return run_dir


@pytest.fixture(scope="module")
def exported(trained):
    out = trained.parent / "model.safetensors"
    proc = script("export.py", trained, out)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def assert_same_weights(export, path) -> None:
    got, want = safetensors.torch.load_file(export), read_model_state(path)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_export_holds_the_newest_checkpoints_weights(trained, exported):
    out, stdout = exported
    assert f"wrote {out}: step 12 of {checkpoint(trained, 12)}" in stdout and "parameters" in stdout
    assert_same_weights(out, checkpoint(trained, 12))
    meta = read_metadata(out)
    manifest = manifest_of(checkpoint(trained, 12))
    assert meta["step"] == 12 and meta["max_seqlen"] == 128
    assert meta["vocab_size"] == manifest["shape"]["vocab_size"]
    assert meta["model_config"] == manifest["config"]["model"]
    assert meta["tokenizer"] == tok.to_json(run_data(checkpoint(trained, 12)).tokenizer)


def test_loaded_export_gives_the_trained_models_logits(trained, exported):
    path = checkpoint(trained, 12)
    model, enc, meta = load_export(exported[0])
    reference, data = checkpoint_model(path), run_data(path)
    assert model.attention.name == "reference" and not model.training
    assert enc.n_vocab == data.tokenizer.n_vocab and enc.encode("abc def") == data.tokenizer.encode("abc def")
    loader = PackedLoader(data, data_config(path), split="val", infinite=False)
    batch = next(loader)
    loader.close()
    args = batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen
    with torch.no_grad():
        assert torch.equal(model(*args), reference(*args))


def test_generate_script_prints_what_generate_gives(trained, exported):
    path = checkpoint(trained, 12)
    data = run_data(path)
    want = generate(
        checkpoint_model(path), data.tokenizer, data.bos_id, "ab", 16, temperature=0.8, top_k=10, seed=7
    )
    proc = script(
        "generate.py",
        exported[0],
        "--prompt",
        "ab",
        "--max-new-tokens",
        16,
        "--seed",
        7,
        "--temperature",
        0.8,
        "--top-k",
        10,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n" and want.startswith("ab")


def test_eval_script_bpb_matches_eval_loss(trained, exported):
    path = checkpoint(trained, 12)
    data = run_data(path)
    loader = PackedLoader(data, data_config(path), split="val", infinite=False)
    want = evaluate(
        checkpoint_model(path).token_losses, loader, token_bytes(data.tokenizer, data.vocab_size), 512, CPU
    )
    loader.close()
    proc = script("eval.py", exported[0], "--eval", "bpb", "--tokens", 512)
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"loss (\d+\.\d+), bits per byte (\d+\.\d+)", proc.stdout)
    assert found, proc.stdout
    assert float(found[1]) == pytest.approx(want["val_loss"], abs=1e-6)
    assert float(found[2]) == pytest.approx(want["val_bpb"], abs=1e-6)
    # The same tokens as the run's own evaluation at step 12 (eval_tokens=512).
    assert float(found[1]) == pytest.approx(metrics(trained)[-1]["val_loss"], abs=1e-6)
    other = script("eval.py", exported[0], "--eval", "bpb", "data.vocab_size=300")
    assert (
        other.returncode != 0
        and "data.vocab_size=300" in other.stderr
        and "another tokenizer" in other.stderr
    )


def test_damaged_and_foreign_files_are_named(exported, tmp_path):
    raw = exported[0].read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ExportInvalid, match=re.escape(f"{truncated} is not a readable safetensors file")):
        load_export(truncated)
    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"weight": torch.zeros(4)}, foreign, metadata={"format": "pt"})
    with pytest.raises(
        ExportInvalid, match=re.escape(f"{foreign} is a safetensors file but not a varlen-gpt")
    ):
        load_export(foreign)
    proc = script("generate.py", truncated, "--prompt", "ab")
    assert proc.returncode != 0 and f"error: {truncated}" in proc.stderr and "Traceback" not in proc.stderr


def test_export_skips_a_damaged_newest_checkpoint(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest = checkpoint(run_dir, 12)
    largest = max((p for p in newest.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:-8])
    out = tmp_path / "model.safetensors"
    proc = script("export.py", run_dir, out)
    assert proc.returncode == 0, proc.stderr
    assert f"skipping {newest}" in proc.stderr and "step 8 of" in proc.stdout
    assert newest.is_dir()  # left as it was: the export only reads the run_dir
    assert_same_weights(out, checkpoint(run_dir, 8))


def test_export_names_a_missing_data_cache(trained, tmp_path):
    path = tmp_path / "step_000012"
    shutil.copytree(checkpoint(trained, 12), path)
    manifest = manifest_of(path)
    manifest["config"]["data"]["cache_dir"] = str(tmp_path / "gone")
    (path / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "model.safetensors"
    proc = script("export.py", path, out)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        f"data.cache_dir={str(tmp_path / 'gone')!r}" in proc.stderr and str(tmp_path / "gone") in proc.stderr
    )
    assert not out.exists()


def test_export_of_a_two_rank_fsdp_run(corpus, tmp_path):
    run_dir = tmp_path / "fsdp"
    run_train(
        ([], small_run(corpus, run_dir, "parallel=fsdp", "max_steps=4", "save_every=4")), torchrun_procs=2
    )
    assert manifest_of(checkpoint(run_dir, 4))["world_size"] == 2
    out = tmp_path / "model.safetensors"
    proc = script("export.py", run_dir, out)
    assert proc.returncode == 0, proc.stderr
    assert_same_weights(out, checkpoint(run_dir, 4))
    model, _, meta = load_export(out)
    assert meta["extra"]["world_size"] == 2 and meta["extra"]["parallel"] == "fsdp"
