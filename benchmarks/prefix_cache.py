"""Prefix cache and session-affine routing of the built-in hf server: prefilled tokens and wall time.

    python benchmarks/prefix_cache.py                 # the 11.9M tiny Qwen2 shape, 3 interleaved rounds

Two servers per setting (one thread each, like a 2-replica CPU run), driven through the real client
(:class:`~areal_cli.inference.client.RemoteInferenceEngine`, least_loaded routing):

- ``old``: ``--prefix-cache-tokens 0``, requests without a session id (the code before the cache);
- ``cache``: the cache on, requests without a session id (a session's turns land on either server);
- ``new``: the cache on, every call carrying its session id (an agent episode's, a GRPO group's).

Scenarios:

- ``agent``: ``--episodes`` concurrent 4-turn episodes sharing a 512-token system prompt (plus a
  32-token task each); every turn generates 32 tokens (greedy) and appends them and a 16-token tool
  result to the conversation;
- ``grpo``: ``--groups`` concurrent GRPO groups of 8, one 256-token prompt per group (no prefix shared
  between groups), each member its own request (as the agent and vLLM paths send them; the hf batch
  path sends a group in one call), 32 seeded-sampled tokens.

Settings are interleaved for ``--rounds`` rounds; before every run the servers' caches are flushed.
Per run: tokens the servers prefilled (computed: ``prefill_tokens`` of ``/get_load``; the rest of the
prompt tokens were copied, from the prefix cache or from an identical running prompt), wall time, and
the CPU seconds of the two server process trees (which moves less than wall time with the load other
processes put on a shared machine). Reported: each setting's median, and the ratio old/setting per
round (median and worst). Outputs of every
request are compared across settings (greedy, and seeded sampling, give the same tokens however the
requests are batched or cached).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # inference_throughput's process-tree CPU

SETTINGS = ("old", "cache", "new")


def _stats(address: str) -> dict:
    import httpx

    return httpx.get(f"http://{address}/get_load", timeout=60).json()["stats"]


def agent_episodes(vocab: int, episodes: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(10, vocab - 10) for _ in range(n)]
    system = tok(512)
    return [{"ctx": system + tok(32), "tools": [tok(16) for _ in range(4)]} for _ in range(episodes)]


def grpo_groups(vocab: int, groups: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(256)] for _ in range(groups)]


async def run_agent(engine, eps: list[dict], keyed: bool, new_tokens: int) -> list[list[int]]:
    from areal_cli.api.io_struct import GenerationConfig, ModelRequest

    g = GenerationConfig(greedy=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    async def episode(i: int, ep: dict) -> list[int]:
        ctx, outs = list(ep["ctx"]), []
        for tool in ep["tools"]:
            r = await engine.agenerate(ModelRequest(input_ids=list(ctx), gconfig=g,
                                                    session_id=f"ep{i}" if keyed else None))
            outs += list(r.output_tokens)
            ctx += list(r.output_tokens) + tool
        return outs

    return list(await asyncio.gather(*(episode(i, ep) for i, ep in enumerate(eps))))


async def run_grpo(engine, prompts: list[list[int]], keyed: bool, new_tokens: int) -> list[list[int]]:
    from areal_cli.api.io_struct import GenerationConfig, ModelRequest

    async def member(gi: int, p: list[int], m: int) -> list[int]:
        g = GenerationConfig(temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             seed=1000 * gi + m)
        r = await engine.agenerate(ModelRequest(input_ids=list(p), gconfig=g,
                                                session_id=f"group{gi}" if keyed else None))
        return list(r.output_tokens)

    return list(await asyncio.gather(*(member(gi, p, m) for gi, p in enumerate(prompts) for m in range(8))))


def one_run(servers: list, scenario: str, work, keyed: bool, new_tokens: int) -> dict:
    import httpx

    from areal_cli.inference.client import RemoteInferenceEngine

    addrs = [s.address for s in servers]
    for a in addrs:
        httpx.post(f"http://{a}/flush_cache", timeout=60).raise_for_status()
    from inference_throughput import _tree_cpu

    before = [_stats(a) for a in addrs]
    engine = RemoteInferenceEngine(addrs, "hf", timeout_s=3600, health_interval_s=3600)
    fn = run_agent if scenario == "agent" else run_grpo
    cpu0 = sum(_tree_cpu(s.proc.pid) for s in servers)
    t0 = time.perf_counter()
    outs = asyncio.run(fn(engine, work, keyed, new_tokens))
    wall = time.perf_counter() - t0
    cpu = sum(_tree_cpu(s.proc.pid) for s in servers) - cpu0
    after = [_stats(a) for a in addrs]

    def delta(k: str) -> int:
        return sum(b2[k] - b1[k] for b1, b2 in zip(before, after))

    return {"prefilled": delta("prefill_tokens"), "cached": delta("cached_prefill_tokens"),
            "shared": delta("shared_prefill_tokens"), "wall": wall, "cpu": cpu, "outs": outs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the 11.9M tiny Qwen2 shape")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    from areal_cli.inference.launch import launch_server
    from areal_cli.models.tiny import make_tiny_model, model_param_count

    path = args.model_path or make_tiny_model(tempfile.mkdtemp(prefix="bench_prefix_"), seed=0, hidden_size=256,
                                              num_layers=12, num_heads=8, num_kv_heads=4,
                                              intermediate_size=1024)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    print(f"model {path}: {model_param_count(path) / 1e6:.1f}M params; 2 servers x 1 thread per setting",
          flush=True)
    env = {"OMP_NUM_THREADS": "1"}
    servers: dict[str, list] = {"off": [], "on": []}
    try:
        for kind, flag in (("off", "0"), ("on", "-1")):
            for _ in range(2):
                servers[kind].append(launch_server("hf", path, timeout_s=600, env=env,
                                                   extra=["--num-threads", "1", "--prefix-cache-tokens", flag]))
        work = {"agent": agent_episodes(vocab, args.episodes), "grpo": grpo_groups(vocab, args.groups)}
        runs: dict[tuple[str, str], list[dict]] = {}
        for rnd in range(args.rounds):
            for scenario in ("agent", "grpo"):
                order = SETTINGS if rnd % 2 == 0 else SETTINGS[::-1]
                for setting in order:
                    srv = servers["off" if setting == "old" else "on"]
                    r = one_run(srv, scenario, work[scenario], keyed=setting == "new", new_tokens=args.new_tokens)
                    runs.setdefault((scenario, setting), []).append(r)
                    print(f"round {rnd} {scenario:5s} {setting:5s} prefilled {r['prefilled']:6d} "
                          f"cached {r['cached']:6d} shared {r['shared']:6d} wall {r['wall']:.2f}s "
                          f"server cpu {r['cpu']:.2f}s", flush=True)
    finally:
        for ss in servers.values():
            for s in ss:
                s.stop()
    return report(runs, args.rounds)


def report(runs: dict, rounds: int) -> int:
    same = True
    print("\n| scenario | setting | prefilled tokens | copied tokens (cache + shared) | wall s | server CPU s |"
          " prefilled old/x (median, worst) | wall old/x (median, worst) | CPU old/x (median, worst) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for scenario in ("agent", "grpo"):
        old = runs[(scenario, "old")]
        for setting in SETTINGS:
            rs = runs[(scenario, setting)]
            same &= all(r["outs"] == old[0]["outs"] for r in rs)
            pre = [o["prefilled"] / max(1, r["prefilled"]) for o, r in zip(old, rs)]
            spd = [o["wall"] / r["wall"] for o, r in zip(old, rs)]
            cpu = [o["cpu"] / r["cpu"] for o, r in zip(old, rs)]
            print(f"| {scenario} | {setting} | {statistics.median(r['prefilled'] for r in rs):.0f} | "
                  f"{statistics.median(r['cached'] + r['shared'] for r in rs):.0f} | "
                  f"{statistics.median(r['wall'] for r in rs):.2f} | {statistics.median(r['cpu'] for r in rs):.2f} | "
                  f"{statistics.median(pre):.2f}x, {min(pre):.2f}x | {statistics.median(spd):.2f}x, {min(spd):.2f}x | "
                  f"{statistics.median(cpu):.2f}x, {min(cpu):.2f}x |")
    print(f"\noutputs identical across settings and rounds: {same}  ({rounds} interleaved rounds)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
