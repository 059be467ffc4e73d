"""The hf server's sampler on the GPU (scripts/gpu_check.sh; docs/gpu_check.md).

Every branch of ``sample_next`` runs on logits that live on the device, against the same logits on the
CPU: greedy, seeded (the inverse-CDF draw), unseeded (the server generator's multinomial), mixed batches,
temperature, top-k/top-p with the sampling mask, and ``min_new_tokens``. The first H200 run of the kit
found the rollout path failing here (a CPU uniform times a CUDA CDF; a CPU generator for a CUDA
multinomial) while greedy evaluation passed, so each branch is checked on its own.
"""

from __future__ import annotations

import pytest
import torch
from gpu_check import DEVICE, needs_cuda, record

from areal_cli.inference.server.sampling import SamplingParams, sample_next

pytestmark = [pytest.mark.gpu, needs_cuda, pytest.mark.timeout(300)]

SP = SamplingParams
CASES = {
    "greedy": [SP(temperature=0.0) for _ in range(4)],
    "seeded": [SP(sampling_seed=100 + i) for i in range(6)],
    "unseeded": [SP() for _ in range(6)],
    "mixed": [SP(temperature=0.0), SP(sampling_seed=7), SP(), SP(sampling_seed=8, temperature=0.7),
              SP(temperature=1.3), SP(top_k=1)],
    "truncated": [SP(sampling_seed=11, top_k=5), SP(sampling_seed=12, top_p=0.8),
                  SP(sampling_seed=13, top_k=20, top_p=0.9, temperature=0.8), SP(temperature=0.0), SP(top_p=0.7)],
    "min_new_tokens": [SP(sampling_seed=21, min_new_tokens=3), SP(min_new_tokens=3), SP(sampling_seed=22)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_mask", [False, True])
def test_sampler_on_the_device_matches_the_cpu(case, with_mask, tmp_path):
    params = CASES[case]
    n, vocab = len(params), 301
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(n, vocab, generator=g) * 3
    eos = {0, 1}
    args = dict(params=params, n_generated=[1] * n, eos_ids=eos, positions=[40 + i for i in range(n)],
                with_mask=with_mask)
    cpu = sample_next(logits, generator=torch.Generator().manual_seed(0), **args)
    dev = sample_next(logits.to(DEVICE), generator=torch.Generator(device=DEVICE).manual_seed(0), **args)
    assert all(t.device.type == torch.device(DEVICE).type for t in dev)
    ids_c, ids_d = cpu[0].tolist(), dev[0].cpu().tolist()
    ref_lp = torch.log_softmax(logits / torch.tensor([1.0 if p.greedy else p.temperature for p in params])
                               .unsqueeze(1), dim=-1)
    deterministic = [p.greedy or p.sampling_seed is not None for p in params]
    for i, p in enumerate(params):
        assert 0 <= ids_d[i] < vocab
        if deterministic[i]:  # greedy and seeded rows depend only on (logits, seed, position)
            assert ids_d[i] == ids_c[i], (case, i, ids_c, ids_d)
        if p.min_new_tokens:
            assert ids_d[i] not in eos
        assert abs(float(dev[1][i]) - float(ref_lp[i, ids_d[i]])) < 1e-4
    if with_mask:
        cut_c, cut_d = cpu[2], dev[2].cpu()
        assert torch.equal(torch.isinf(cut_c), torch.isinf(cut_d))
        fin = ~torch.isinf(cut_c)
        assert torch.allclose(cut_c[fin], cut_d[fin], atol=1e-5)
        det = torch.tensor(deterministic)
        assert torch.allclose(cpu[3][det], dev[3].cpu()[det], atol=1e-4)
    record(f"sampling_{case}{'_mask' if with_mask else ''}",
           {"rows": n, "ids_cpu": ids_c, "ids_device": ids_d}, tmp_path)
