"""Prompt pool: ensemble formula, top-k, merging, persistence and its failure messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clova_train.core.errors import PoolError
from clova_train.core.pool import PoolSpec, PromptPool

SPEC = PoolSpec("clip", "open_clip:abc", (2, 3), 4)


def naive_ensemble(features: torch.Tensor, prompts: torch.Tensor, query: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
    """The paper's formula written as a plain loop (the reference implementation's way)."""
    sims = [float(F.cosine_similarity(query, f, dim=0)) for f in features]
    order = sorted(range(len(sims)), key=lambda i: -sims[i])[: top_k or len(sims)]
    total = sum(sims[i] for i in order)
    return sum(sims[i] * prompts[i] for i in order) / total


def make_pool(n: int = 6, seed: int = 0, spec: PoolSpec = SPEC) -> tuple[PromptPool, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    feats = torch.rand(n, spec.feature_dim, generator=g) + 0.1  # positive: cosines are positive
    prompts = torch.randn(n, *spec.prompt_shape, generator=g)
    pool = PromptPool(spec)
    pool.add("horse", feats, prompts, [f"horse/{i}" for i in range(n)])
    return pool, feats, prompts


@pytest.mark.parametrize("n", [3, 50])  # 50 > feature_dim uses the factored form
def test_ensemble_matches_paper_formula(n: int) -> None:
    pool, feats, prompts = make_pool(n)
    query = torch.rand(4) + 0.1
    expected = naive_ensemble(feats, prompts, query)
    torch.testing.assert_close(pool.retrieve("horse", query), expected, rtol=1e-5, atol=1e-5)


def test_top_k_uses_only_most_similar() -> None:
    pool, feats, prompts = make_pool(10)
    query = torch.rand(4) + 0.1
    torch.testing.assert_close(pool.retrieve("horse", query, top_k=3), naive_ensemble(feats, prompts, query, 3))


def test_batched_queries_match_single_queries() -> None:
    pool, _, _ = make_pool(50)
    queries = torch.rand(5, 4)
    batched = pool.retrieve("horse", queries)
    assert batched.shape == (5, 2, 3)
    for q, row in zip(queries, batched):
        torch.testing.assert_close(pool.retrieve("horse", q), row)


def test_absent_concept_means_unmodified_tool() -> None:
    pool, _, _ = make_pool()
    assert pool.retrieve("zebra", torch.rand(4)) is None


def test_dissimilar_query_falls_back_to_mean() -> None:
    pool = PromptPool(SPEC)
    feats = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    prompts = torch.stack([torch.ones(2, 3), 3 * torch.ones(2, 3)])
    pool.add("horse", feats, prompts)
    out = pool.retrieve("horse", torch.tensor([-1.0, -1.0, 0, 0]))  # both cosines negative
    torch.testing.assert_close(out, 2 * torch.ones(2, 3))


def test_add_rejects_wrong_shapes() -> None:
    pool = PromptPool(SPEC)
    with pytest.raises(PoolError, match="prompts for concept 'horse' have shape"):
        pool.add("horse", torch.rand(1, 4), torch.rand(1, 3, 3))
    with pytest.raises(PoolError, match="features for concept 'horse'"):
        pool.add("horse", torch.rand(1, 5), torch.rand(1, 2, 3))


def test_merge_keeps_each_instance_once() -> None:
    a, _, _ = make_pool(4, seed=0)
    b, _, _ = make_pool(6, seed=1)  # ids horse/0..5: 0..3 overlap with a
    added = a.merge(b)
    assert added == 2 and a.num_prompts("horse") == 6


def test_merge_refuses_other_model() -> None:
    a, _, _ = make_pool()
    b, _, _ = make_pool(spec=PoolSpec("clip", "open_clip:other", (2, 3), 4))
    with pytest.raises(PoolError, match="model_identity"):
        a.merge(b)


def test_save_load_roundtrip(tmp_path: Path) -> None:
    pool, _, _ = make_pool(5)
    pool.add("zebra", torch.rand(2, 4), torch.rand(2, 2, 3))
    path = pool.save(tmp_path / "pool.safetensors")
    loaded = PromptPool.load(path, expected=SPEC)
    assert loaded.concepts == ["horse", "zebra"] and len(loaded) == 7
    for concept in pool.concepts:
        for x, y in zip(pool.entry(concept)[:2], loaded.entry(concept)[:2]):
            assert torch.equal(x, y)
        assert pool.entry(concept)[2] == loaded.entry(concept)[2]


def test_load_names_model_mismatch(tmp_path: Path) -> None:
    path = make_pool()[0].save(tmp_path / "pool.safetensors")
    other = PoolSpec("clip", "open_clip:other", (2, 3), 4)
    with pytest.raises(PoolError, match=r"pool\.safetensors does not fit this model: model_identity is 'open_clip:abc'"):
        PromptPool.load(path, expected=other)
    with pytest.raises(PoolError, match=r"prompt_shape is \(2, 3\) in the pool but \(3, 100, 8\)"):
        PromptPool.load(path, expected=PoolSpec("clip", "open_clip:abc", (3, 100, 8), 4))


def test_load_rejects_corrupted_file(tmp_path: Path) -> None:
    path = make_pool()[0].save(tmp_path / "pool.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(PoolError, match="pool.safetensors is corrupted or unreadable"):
        PromptPool.load(path)
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(PoolError, match="corrupted or unreadable"):
        PromptPool.load(path)


def test_load_rejects_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="not found"):
        PromptPool.load(tmp_path / "nope.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(PoolError, match="not a clova-train prompt pool"):
        PromptPool.load(tmp_path / "other.safetensors")


def test_metadata_is_self_describing(tmp_path: Path) -> None:
    from safetensors import safe_open

    path = make_pool(3)[0].save(tmp_path / "pool.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["clova_train.pool"])
    assert meta["tool"] == "clip" and meta["prompt_shape"] == [2, 3] and meta["feature_dim"] == 4
    assert meta["format_version"] == 1 and meta["concepts"][0]["num_prompts"] == 3


def test_failed_save_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_pool(3)[0].save(tmp_path / "pool.safetensors")
    before = path.read_bytes()
    import clova_train.core.pool as pool_module

    def broken_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pool_module, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        make_pool(5)[0].save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["pool.safetensors"]
