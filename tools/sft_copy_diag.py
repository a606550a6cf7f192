"""Question: how fast does SFT teach the quickstart's tiny model to copy numbers (bench/history/quickstart.md)?

Trains the tiny model on Calculator demonstrations and prints, every 50 steps, per-token loss and
the share of tokens above p=0.5 on 64 held-out tool-using demonstrations (teacher-forced), split into
format tokens, digits of the tool call and digits of the final answer.

    python tools/sft_copy_diag.py --model .cache/tiny-model --steps 600 --lr 1e-3 --numw 5
    python tools/sft_copy_diag.py --model .cache/quickstart-sft --steps 0     # evaluate only

--numw weights digit tokens, --callw weights tokens inside <tool_call>...</tool_call>, --guess and
--easy are the expert's guess_prob / easy_guess_prob.
"""
import argparse
import math
import random
import time

import torch
from pathlib import Path
from transformers import AutoTokenizer
from agentrl.rollout.chat import ChatRenderer
from agentrl.driver.sft import build_demonstrations, digit_tokens
from agentrl.learner.hf_forward import packed_token_logprobs
from agentrl.model.loading import load_hf_model
from agentrl.learner.packing import make_microbatches, pack_sequences
ap = argparse.ArgumentParser()
ap.add_argument("--model", default=".cache/tiny-model")
ap.add_argument("--steps", type=int, default=400)
ap.add_argument("--lr", type=float, default=2e-3)
ap.add_argument("--batch", type=int, default=4096)
ap.add_argument("--demos", type=int, default=3000)
ap.add_argument("--guess", type=float, default=0.0)
ap.add_argument("--numw", type=float, default=1.0)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--wd", type=float, default=0.0)
ap.add_argument("--warm", type=int, default=20)
ap.add_argument("--easy", type=float, default=None)
ap.add_argument("--callw", type=float, default=1.0)
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(a.model)
r = ChatRenderer(tok)
digit = digit_tokens(tok)
end_call = tok.convert_tokens_to_ids("</tool_call>")
start_call = tok.convert_tokens_to_ids("<tool_call>")
def cats(ids, mask):
    c = []; after = False
    for i, m in zip(ids, mask):
        if not m: c.append(0); continue
        if digit[i]: c.append(3 if after else 2)
        else: c.append(1)
        if i == end_call: after = True
    return c
train = build_demonstrations("agentrl/Calculator-v0", r, list(range(2_000_000, 2_000_000 + a.demos)), None, guess_prob=a.guess, easy_guess_prob=a.easy)
held = build_demonstrations("agentrl/Calculator-v0", r, list(range(3_000_000, 3_000_064)), None, guess_prob=0.0)
model = load_hf_model(a.model, "float32"); model.train()
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd, betas=(0.9, 0.98))
lengths = [len(i) for i, _ in train]
batches = make_microbatches(lengths, a.batch, algorithm="mffd")[0]
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / a.warm))
hp = pack_sequences([d[0] for d in held], {"loss_mask": [d[1] for d in held], "cat": [cats(*d) for d in held]})
def evaluate():
    model.eval()
    with torch.no_grad():
        lp = packed_token_logprobs(model, hp, chunk_size=1024).reshape(-1)
    model.train()
    c = hp.fields["cat"].reshape(-1)
    out = {}
    for k, name in [(1, "fmt"), (2, "call#"), (3, "ans#")]:
        m = c == k
        out[name] = round(-lp[m].mean().item(), 3) if m.any() else None
        out[name+"_p>.5"] = round((lp[m] > math.log(0.5)).float().mean().item(), 3) if m.any() else None
    return out
if a.steps == 0: print("eval", evaluate()); raise SystemExit
rng = random.Random(0); step = 0; t0 = time.perf_counter()
while step < a.steps:
    rng.shuffle(batches)
    for b in batches:
        packed = pack_sequences([train[i][0] for i in b], {"loss_mask": [train[i][1] for i in b]})
        logp = packed_token_logprobs(model, packed, chunk_size=1024).reshape(-1)
        ids = packed.input_ids.reshape(-1)
        mask = packed.fields["loss_mask"].reshape(-1) > 0
        w = mask.float()
        if a.numw != 1.0:
            w = w * torch.where(digit[ids], a.numw, 1.0)
        if a.callw != 1.0:
            incall = torch.zeros_like(w)
            flat = packed.input_ids.reshape(-1).tolist(); inside = False
            for j, t in enumerate(flat):
                if t == start_call: inside = True
                if inside: incall[j] = 1.0
                if t == end_call: inside = False
            w = w * torch.where(incall > 0, a.callw, 1.0)
        loss = -(logp * w).sum() / w.sum()
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); sched.step()
        step += 1
        if step % 50 == 0:
            print(step, f"{time.perf_counter()-t0:.0f}s", f"loss {loss.item():.3f}", evaluate(), flush=True)
        if step >= a.steps: break
