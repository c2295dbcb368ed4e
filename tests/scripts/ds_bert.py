"""A DeepSpeedExamples-style masked language model (training/HelloDeepSpeed/train_bert_ds.py), written for
DeepSpeed: a tiny BERT encoder on random token ids, ZeRO stage 3 with gradient accumulation, a
checkpoint, and the fp32 weights read back through `deepspeed.utils.zero_to_fp32`.

Its import lines are DeepSpeed's; the test replaces `deepspeed` with `zerodp.deepspeed` in them and
nothing else. Every sequence masks the same number of tokens, so each micro-batch's mean loss weighs
alike (the data-parallel mean is then the mean over the whole batch).
"""

import argparse
import os

import deepspeed
import torch
import torch.nn as nn
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch.utils.data import TensorDataset

VOCAB, SEQ, MASKED, MASK_ID = 50, 12, 3, 1


class BertLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden)
        self.intermediate = nn.Linear(hidden, 2 * hidden)
        self.output = nn.Linear(2 * hidden, hidden)
        self.out_norm = nn.LayerNorm(hidden)

    def forward(self, h):
        b, s, d = h.shape
        q, k, v = (f(h).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        h = self.attn_norm(h + self.attn_out(a))
        return self.out_norm(h + self.output(nn.functional.gelu(self.intermediate(h))))


class BertMLM(nn.Module):
    def __init__(self, vocab=VOCAB, hidden=16, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(SEQ, hidden) * 0.02)
        self.layers = nn.ModuleList(BertLayer(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # BERT ties its decoder to the embeddings
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids) + self.pos
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def masked_corpus(n=32):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    where = torch.rand(n, SEQ, generator=g).argsort(1)[:, :MASKED]
    labels = torch.full_like(tokens, -100).scatter(1, where, tokens.gather(1, where))
    return TensorDataset(tokens.scatter(1, where, MASK_ID), labels)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    deepspeed.init_distributed()
    torch.manual_seed(7)
    model = BertMLM()
    engine, _, loader, scheduler = deepspeed.initialize(args=args, model=model, training_data=masked_corpus(),
                                                        model_parameters=model.parameters())
    device = torch.device(get_accelerator().current_device_name())
    losses = []
    for step, (input_ids, labels) in enumerate(loader):
        loss = engine(input_ids.to(device), labels.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if engine.was_step_applied():
            log_dist(f"step {engine.global_steps} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                     ranks=[0])
    engine.save_checkpoint(args.checkpoint_dir, tag="final")
    dist.barrier()
    weights = None
    if dist.get_rank() == 0:
        weights = get_fp32_state_dict_from_zero_checkpoint(args.checkpoint_dir)
    return {"losses": losses, "weights": weights, "steps": engine.global_steps,
            "saved": sorted(os.listdir(args.checkpoint_dir))}


if __name__ == "__main__":
    main()
