"""Two gloo ranks: ``parallelize.apply_fsdp`` on a tiny tied (or untied) Qwen2; report whether the embedding is
resharded between the forward and the backward, and the gradients a step of two micro-batches gives."""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_cli.engines import parallelize as par

    spec = json.loads(sys.argv[1])
    tied, out = spec["tie"] == "tied", spec["out"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=3000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(cfg)
    ref = Qwen2ForCausalLM(cfg)
    ref.load_state_dict(model.state_dict())
    par.apply_fsdp(model, init_device_mesh("cpu", (world,)))
    emb = model.get_input_embeddings()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 3000, (2, 12), generator=gen) for _ in range(2 * world)]
    sharded_between = []
    for ids in batches[rank::world]:  # this rank's two micro-batches
        loss = model(input_ids=ids, labels=ids).loss
        sharded_between.append(isinstance(emb.weight, DTensor))  # resharded after the forward?
        loss.backward()
    for ids in batches:  # the one-process reference: every micro-batch's loss, summed as FSDP sums ranks
        ref(input_ids=ids, labels=ids).loss.backward()
    diff = max((p.grad.full_tensor() - r.grad).abs().max().item()
               for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"sharded_between": sharded_between, "grad_diff": diff,
                       "head_is_embedding": model.get_output_embeddings().weight is emb.weight}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
