"""The Megatron engine never materialises the whole model on a rank that holds a shard.

- Loading: each rank reads from the safetensors only the tensors its chunks own (its stage's layers, its ep
  rank's experts), column-parallel ones as their dim-0 slices, so it reads at most its share of the checkpoint
  plus about one layer (row-parallel tensors are read whole, then sliced); ``AutoModelForCausalLM.from_pretrained``
  and whole-file safetensors loads never run in a megatron trainer process. Loading an HF dir into a running
  engine (``load(weight_format="hf")``) reads the same way.
- Export: only data-parallel replica 0 gathers (the other replicas take part in no gather), experts only on
  expert-data-parallel replica 0, and the export is still the checkpoint, bit for bit.
- Checkpoints (``weight_format="dcp"``) at d2: one model file (written by dp rank 0), the optimizer state once
  without the distributed optimizer and per rank with it, and resume from them is bit-exact.

Layouts: t2p2 and d2t2 on the tiny 4-layer Qwen2 (tied), d4e2 on the tiny Qwen3-MoE (4 processes). Behind the
`megatron` marker (`pytest -m megatron tests/integration`).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from fsdp_worker import launch  # noqa: E402
from support_paths import SUPPORT

from areal_cli.engines.megatron import compat  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.skipif(compat.installed_version() != compat.SUPPORTED_VERSION,
                                 reason=f"megatron-core {compat.SUPPORTED_VERSION} is not installed "
                                        "(scripts/install_test_deps.sh installs it)")]

# column-parallel HF tensors: a rank of t reads exactly 1/t of each (a dim-0 slice)
COLUMN = re.compile(r"(embed_tokens|[qkv]_proj|gate_proj|up_proj)\.(weight|bias)$")
LAYER = re.compile(r"model\.layers\.(\d+)\.")


@pytest.fixture(scope="module")
def sharded(model4, moe_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_sharded")
    cases = [{"name": "t2p2", "model_dir": model4, "parallel": {"tp": 2, "pp": 2}},
             {"name": "d2t2", "model_dir": model4, "parallel": {"dp": 2, "tp": 2}},
             {"name": "d4e2", "model_dir": moe_model, "parallel": {"dp": 4, "ep": 2}}]
    launch({"mode": "sharded", "out": str(out), "cases": cases}, 4, timeout=600,
           script=str(SUPPORT / "megatron_worker.py"))
    return json.loads((out / "result.json").read_text())


def _layer_bytes(sizes: dict) -> int:
    per: dict[int, int] = {}
    for n, b in sizes.items():
        m = LAYER.match(n)
        if m:
            per[int(m.group(1))] = per.get(int(m.group(1)), 0) + b
    return max(per.values())


def _stage_layers(n_layers: int, pp: int, stage: int) -> set[int]:
    k = n_layers // pp
    return set(range(stage * k, (stage + 1) * k))


@pytest.mark.parametrize("case,shards", [("t2p2", 4), ("d2t2", 2), ("d4e2", 1)])
def test_no_rank_reads_the_whole_model(sharded, case, shards):
    r = sharded[case]
    sizes, total = r["sizes"], sum(r["sizes"].values())
    budget = total / shards + _layer_bytes(sizes)
    for rank in r["ranks"]:
        assert rank["from_pretrained"] == 0, "AutoModelForCausalLM.from_pretrained ran in a megatron trainer"
        assert rank["load_file_model"] == 0, "a whole safetensors model file was loaded"
        for phase in ("init_reads", "load_reads"):
            read = rank[phase]
            assert sum(read.values()) <= budget, (case, rank["coords"], phase, sum(read.values()), budget, total)
            assert sum(read.values()) < total
            for name, b in read.items():
                assert b <= sizes[name], (name, b)  # no tensor read twice


@pytest.mark.parametrize("case,tp,pp", [("t2p2", 2, 2), ("d2t2", 2, 1)])
def test_ranks_read_only_their_stage_and_column_slices(sharded, case, tp, pp):
    r = sharded[case]
    n_layers = 1 + max(int(m.group(1)) for n in r["sizes"] if (m := LAYER.match(n)))
    for rank in r["ranks"]:
        stage = rank["coords"][0]
        read = rank["init_reads"]
        layers = {int(m.group(1)) for n in read if (m := LAYER.match(n))}
        assert layers == _stage_layers(n_layers, pp, stage), (rank["coords"], layers)
        for name, b in read.items():
            if COLUMN.search(name):
                assert b == r["sizes"][name] // tp, (name, b, r["sizes"][name])


def test_experts_are_read_only_by_their_expert_rank(sharded):
    r = sharded["d4e2"]
    n_experts = 1 + max(int(m.group(1)) for n in r["sizes"] if (m := re.search(r"experts\.(\d+)\.", n)))
    for rank in r["ranks"]:
        ep_rank = rank["coords"][3]
        read = {int(m.group(1)) for n in rank["init_reads"] if (m := re.search(r"experts\.(\d+)\.", n))}
        per = n_experts // 2
        assert read == set(range(ep_rank * per, (ep_rank + 1) * per)), (rank["coords"], read)


@pytest.mark.parametrize("case", ["t2p2", "d2t2", "d4e2"])
def test_only_data_parallel_replica_zero_gathers_and_the_export_is_exact(sharded, case):
    ranks = sharded[case]["ranks"]
    assert ranks[0]["export_diff"] == [], ranks[0]["export_diff"]
    for rank in ranks:
        _pp, _tp, dp, ep, _etp, edp = rank["coords"]
        # dense tensors: gathered (over TP) by replica 0 only; the other replicas take part in none
        assert (rank["export_gathers"] > 0) == (dp == 0), rank
        if case == "d4e2":  # each ep rank's experts: gathered by its expert-data-parallel replica 0 only
            assert (rank["export_expert_gathers"] > 0) == (edp == 0), rank
        else:
            assert rank["export_expert_gathers"] == 0, rank


OPTIM = {"lr": 1e-3, "lr_scheduler": "cosine", "warmup_steps": 2, "weight_decay": 0.01, "grad_clip": 0.5,
         "eps": 1e-2}


def _ck(name, distributed, **kw):
    return {"name": name, "cls": "megatron", "parallel": {"dp": 2}, "optim": OPTIM, "total_steps": 4,
            "engine": {"max_tokens_per_mb": 40, "megatron": {"use_distributed_optimizer": distributed}}, **kw}


def test_d2_checkpoint_writes_the_model_once_and_resumes_exactly(model4, tmp_path):
    out, ck_do, ck_plain = tmp_path / "out", tmp_path / "ck_do", tmp_path / "ck_plain"
    out.mkdir()
    launch({"model_dir": model4, "out": str(out), "variants": [
        _ck("full_do", True, steps=4), _ck("full_plain", False, steps=4),
        _ck("first_do", True, steps=2, save=str(ck_do)),
        _ck("first_plain", False, steps=2, save=str(ck_plain), kill_after=True),
    ]}, 2, expect_kill=True, timeout=600)
    launch({"model_dir": model4, "out": str(out), "variants": [
        _ck("resumed_do", True, start=2, steps=4, load=str(ck_do)),
        _ck("resumed_plain", False, start=2, steps=4, load=str(ck_plain)),
    ]}, 2, timeout=600)
    for ck, sharded_optim in ((ck_do, True), (ck_plain, False)):
        models = sorted(p.name for p in ck.glob("megatron_model_*.pt"))
        assert models == ["megatron_model_pp0_tp0_ep0_etp0.pt"], models  # dp rank 0's, once
        ranks = [torch.load(ck / f"megatron_rank{r}.pt", weights_only=False) for r in range(2)]
        model = torch.load(ck / models[0], weights_only=False)
        # the distributed optimizer's shards differ per rank; the plain optimizer's state goes once
        assert all(("optim" in r) == sharded_optim for r in ranks)
        assert ("optim" in model) != sharded_optim
        assert all("chunks" not in r for r in ranks)
    for kind in ("do", "plain"):
        full, resumed = (torch.load(out / f"{n}_{kind}.pt", weights_only=False) for n in ("full", "resumed"))
        assert [s["lr"] for s in resumed["stats"]] == [s["lr"] for s in full["stats"][2:]]
        assert [s["loss"] for s in resumed["stats"]] == [s["loss"] for s in full["stats"][2:]]
        for k, w in full["weights"].items():
            assert torch.equal(w, resumed["weights"][k]), f"{kind}: {k} differs after resume"
