"""Export from a run or checkpoint, and the Lightning-free serving loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from clova_train.cli import main
from clova_train.tools.images import list_images, load_image
from clova_train.core.errors import ExportError
from clova_train.core.pool import PromptPool
from clova_train.tools.prompt_server import PromptToolServer
from helpers.common import fit_args, run_fit


@pytest.fixture(scope="module")
def finished_run(tiny_clip_dir: Path, concept_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, run_dir, "--model.init_args.steps=30")) == 0
    return run_dir


def test_export_from_run_dir_is_self_describing(finished_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert main(["export", str(finished_run), "--output", str(out)]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"pool.safetensors", "tool.json", "summary.json", "versions.json", "export.json"} <= files
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["format_version"] == 1 and manifest["source"]["kind"] == "run_dir"
    assert "torch" in json.loads((out / "versions.json").read_text())
    assert PromptPool.load(out / "pool.safetensors").concepts == PromptPool.load(finished_run / "pool.safetensors").concepts


def test_export_from_checkpoint_matches_run(finished_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "from_ckpt"
    assert main(["export", str(finished_run / "checkpoints" / "last.ckpt"), "-o", str(out)]) == 0
    a, b = PromptPool.load(out / "pool.safetensors"), PromptPool.load(finished_run / "pool.safetensors")
    assert a.concepts == b.concepts
    for concept in a.concepts:
        assert torch.equal(a.entry(concept)[1], b.entry(concept)[1])


def test_export_errors_keep_previous_export(finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "export"
    assert main(["export", str(finished_run), "-o", str(out)]) == 0
    before = (out / "pool.safetensors").read_bytes()
    broken_run = tmp_path / "broken_run"
    broken_run.mkdir()
    (broken_run / "tool.json").write_text((finished_run / "tool.json").read_text())
    (broken_run / "pool.safetensors").write_bytes(b"garbage")
    assert main(["export", str(broken_run), "-o", str(out)]) == 2
    assert "broken_run/pool.safetensors is corrupted or unreadable" in capsys.readouterr().err
    assert (out / "pool.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken_run", "export"]  # no staging left behind
    assert main(["export", str(tmp_path / "absent"), "-o", str(out)]) == 2
    assert "export source not found" in capsys.readouterr().err


def test_server_uses_pool_and_matches_training_encoder(finished_run: Path, concept_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    main(["export", str(finished_run), "-o", str(out)])
    server = PromptToolServer.from_export(out)
    concept = server.pool.concepts[0]
    images = torch.stack([load_image(p, 32) for p in list_images(concept_root / concept)[:3]])
    base = server.tool.encode_image(images)
    prompts = server.prompts_for(concept, base)
    expected = server.pool.retrieve(concept, base)
    assert prompts is not None and torch.allclose(prompts, expected)
    assert server.prompts_for("zebra", base) is None  # unknown concept: unmodified tool
    labels, scores = server.classify(images, server.pool.concepts)
    assert len(labels) == 3 and scores.shape == (3, len(server.pool.concepts))
    assert torch.all((scores >= 0) & (scores <= 1))
    index, crop_scores = server.select(images, concept)
    assert 0 <= index < 3 and crop_scores.shape == (3,)


@pytest.mark.slow
def test_server_in_a_fresh_process_without_lightning(finished_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    main(["export", str(finished_run), "-o", str(out)])
    code = (
        "import sys, torch\n"
        "from clova_train.tools.prompt_server import PromptToolServer\n"
        f"s = PromptToolServer.from_export({str(out)!r})\n"
        "labels, _ = s.classify(torch.rand(2, 3, 32, 32), s.pool.concepts)\n"
        "assert 'lightning' not in sys.modules, 'serving imported lightning'\n"
        "print('served', len(labels))\n"
    )
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "served 2" in result.stdout


def test_server_refuses_export_for_other_weights(finished_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    main(["export", str(finished_run), "-o", str(out)])
    tool = json.loads((out / "tool.json").read_text())
    tool["identity"] = "open_clip:0000000000000000"
    (out / "tool.json").write_text(json.dumps(tool))
    with pytest.raises(ExportError, match="prompts were trained on open_clip:0000000000000000"):
        PromptToolServer.from_export(out)
    (out / "pool.safetensors").unlink()
    with pytest.raises(ExportError, match="pool.safetensors missing"):
        PromptToolServer.from_export(out)


def test_export_card_reads_and_ensembles_the_pool_without_clova_train(finished_run: Path, tmp_path: Path) -> None:
    """The card's own code block, run with clova-train blocked, gives the server's ensembled prompts."""
    import re

    from helpers.standalone import run_without_package

    out = tmp_path / "export"
    assert main(["export", str(finished_run), "--output", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert "clova-train serve" in card and "How the prompts enter the tool" in card
    assert "SERVED_TOP_K = 10" in card and "over the 10 most similar stored prompts" in card  # the tool's own top_k
    (code,) = re.findall(r"```python\n(.*?)```", card, re.S)
    pool = PromptPool.load(out / "pool.safetensors")
    queries = torch.randn(6, pool.spec.feature_dim, generator=torch.Generator().manual_seed(0))
    queries[0] = 0  # every similarity ties (at 0): top_k keeps the earlier stored prompts, and their plain mean
    cases = [(concept, top_k) for concept in [*pool.concepts, "no-such-concept"] for top_k in (None, 1, 2)]
    got = run_without_package(code + f"""
queries = np.asarray({queries.tolist()!r}, dtype=np.float32)
results = []
for concept, top_k in {cases!r}:
    prompts = [ensemble(concept, q, top_k) for q in queries]
    results.append(None if prompts[0] is None else np.stack(prompts).tolist())
print(json.dumps(results))
""", cwd=out)
    for (concept, top_k), result in zip(cases, got):
        expected = pool.retrieve(concept, queries, top_k=top_k)
        if expected is None:
            assert result is None, concept
        else:
            np.testing.assert_allclose(np.asarray(result), expected.numpy(), atol=1e-5, err_msg=f"{concept} {top_k}")
