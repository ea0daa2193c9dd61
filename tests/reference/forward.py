#!/usr/bin/env python3
"""Independent numpy reference of the llama / qwen2 forward pass, read from a GGUF file.

mtpx's real-model parity tests compare the Rust engine against this script. It shares nothing
with the engine: weights are read and dequantized by the `gguf` PyPI package, every step is
plain numpy in float32 (norm statistics and rotary angles in float64).

Usage:
  forward.py --model M.gguf --tokens-file IDS.json --mode logits [--out L.npy] [--top1-out T.npy]
      Teacher-forced logits for every position of IDS.json (a JSON list of token ids):
      --out writes float32 [n, vocab], --top1-out writes int64 [n] (argmax per position).
  forward.py --model M.gguf --tokens-file IDS.json --mode greedy --steps 32 [--ignore-eos]
      Greedy continuation after the prompt: a JSON list of token ids on stdout, at most STEPS,
      ending with the end-of-generation token if one was produced (unless --ignore-eos).
  forward.py --model M.gguf --tokens-file IDS.json --mode embedding --out E.npy
      The hidden states after the final norm pooled two ways, each scaled to unit length:
      float32 [2, hidden], the mean over positions and then the last position's.

Conventions (as llama.cpp reads these GGUF files):
  - numpy arrays from gguf have the GGUF dims reversed: a matrix is [out_features, in_features].
  - llama: rotary on interleaved pairs (x[2i], x[2i+1]) (the converter permuted Q/K for this).
  - qwen2: rotary on halves (x[i], x[i + d/2]) ("neox"), and Q/K/V carry biases.
  - the output projection is tied to token_embd when `output.weight` is absent.
Timings go to stderr.
"""

import argparse
import json
import sys
import time

import gguf
import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2")


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class Config:
    def __init__(self, reader):
        arch = field(reader, "general.architecture")
        if arch not in SUPPORTED_ARCHS:
            sys.exit(f"unsupported architecture {arch!r} (supported: {SUPPORTED_ARCHS})")
        self.arch = arch
        self.hidden = int(field(reader, f"{arch}.embedding_length"))
        self.num_layers = int(field(reader, f"{arch}.block_count"))
        self.num_heads = int(field(reader, f"{arch}.attention.head_count"))
        self.num_kv_heads = int(field(reader, f"{arch}.attention.head_count_kv", self.num_heads))
        self.eps = float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon"))
        self.rope_theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
        self.context_length = int(field(reader, f"{arch}.context_length"))
        self.head_dim = self.hidden // self.num_heads
        self.rope_dim = int(field(reader, f"{arch}.rope.dimension_count", self.head_dim))
        self.rope_neox = arch == "qwen2"
        eos_ids = [field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.eot_token_id")]
        self.eos_ids = {int(t) for t in eos_ids if t is not None}


class Weights:
    """Dequantized float32 tensors by GGUF name; matrices are [out_features, in_features]."""

    def __init__(self, reader):
        self.tensors = {t.name: t for t in reader.tensors}

    def __contains__(self, name):
        return name in self.tensors

    def get(self, name):
        t = self.tensors[name]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(t.shape))
        assert w.shape == expected, f"{name}: {w.shape} != {expected}"
        return np.ascontiguousarray(w)

    def get_optional(self, name):
        return self.get(name) if name in self else None


def rms_norm(x, weight, eps):
    """x [n, d] -> [n, d]."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)).astype(np.float32) * weight


def rope(x, positions, cfg):
    """Rotates x [n, heads, head_dim] by the angles of `positions` [n] (first rope_dim dims)."""
    half = cfg.rope_dim // 2
    inv_freq = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [n, half]
    cos = np.cos(angles).astype(np.float32)[:, None, :]  # [n, 1, half]
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    if cfg.rope_neox:
        first, second = slice(0, half), slice(half, cfg.rope_dim)
    else:
        first, second = slice(0, cfg.rope_dim, 2), slice(1, cfg.rope_dim, 2)
    out = x.copy()
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x2 * cos + x1 * sin
    return out


def linear(x, w, b=None):
    """x [n, in] @ w [out, in]^T (+ b [out]) -> [n, out]."""
    y = x @ w.T
    return y if b is None else y + b


def silu(x):
    return x / (1.0 + np.exp(-x))


class Layer:
    def __init__(self, weights, i):
        p = f"blk.{i}."
        self.attn_norm = weights.get(p + "attn_norm.weight")
        self.wq, self.bq = weights.get(p + "attn_q.weight"), weights.get_optional(p + "attn_q.bias")
        self.wk, self.bk = weights.get(p + "attn_k.weight"), weights.get_optional(p + "attn_k.bias")
        self.wv, self.bv = weights.get(p + "attn_v.weight"), weights.get_optional(p + "attn_v.bias")
        self.wo = weights.get(p + "attn_output.weight")
        self.ffn_norm = weights.get(p + "ffn_norm.weight")
        self.w_gate = weights.get(p + "ffn_gate.weight")
        self.w_up = weights.get(p + "ffn_up.weight")
        self.w_down = weights.get(p + "ffn_down.weight")


class Model:
    def __init__(self, path):
        reader = gguf.GGUFReader(path)
        self.cfg = Config(reader)
        weights = Weights(reader)
        self.token_embd = weights.get("token_embd.weight")  # [vocab, hidden]
        self.layers = [Layer(weights, i) for i in range(self.cfg.num_layers)]
        self.output_norm = weights.get("output_norm.weight")
        output = weights.get_optional("output.weight")
        self.output = self.token_embd if output is None else output  # [vocab, hidden]

    def new_cache(self):
        """Per layer (k, v), each [num_kv_heads, num_positions, head_dim]."""
        cfg = self.cfg
        empty = np.zeros((cfg.num_kv_heads, 0, cfg.head_dim), dtype=np.float32)
        return [(empty, empty) for _ in self.layers]

    def forward(self, token_ids, cache):
        """Appends `token_ids` after the positions in `cache`; returns logits [n, vocab]."""
        return linear(self.hidden(token_ids, cache), self.output)

    def hidden(self, token_ids, cache):
        """As `forward`, but returns the hidden states after the final norm [n, hidden]."""
        start = cache[0][0].shape[1]
        positions = np.arange(start, start + len(token_ids))
        x = self.token_embd[np.asarray(token_ids)]  # [n, hidden]
        for i, layer in enumerate(self.layers):
            x, cache[i] = self.block(layer, x, positions, cache[i])
        return rms_norm(x, self.output_norm, self.cfg.eps)

    def block(self, layer, x, positions, kv):
        cfg = self.cfg
        h = rms_norm(x, layer.attn_norm, cfg.eps)
        attn, kv = self.attention(layer, h, positions, kv)
        x = x + attn
        h = rms_norm(x, layer.ffn_norm, cfg.eps)
        x = x + linear(silu(linear(h, layer.w_gate)) * linear(h, layer.w_up), layer.w_down)
        return x, kv

    def attention(self, layer, h, positions, kv):
        cfg = self.cfg
        n, hd = h.shape[0], cfg.head_dim
        q = linear(h, layer.wq, layer.bq).reshape(n, cfg.num_heads, hd)
        k = linear(h, layer.wk, layer.bk).reshape(n, cfg.num_kv_heads, hd)
        v = linear(h, layer.wv, layer.bv).reshape(n, cfg.num_kv_heads, hd)
        q, k = rope(q, positions, cfg), rope(k, positions, cfg)
        k_all = np.concatenate([kv[0], k.transpose(1, 0, 2)], axis=1)  # [kv_heads, t, hd]
        v_all = np.concatenate([kv[1], v.transpose(1, 0, 2)], axis=1)
        group = cfg.num_heads // cfg.num_kv_heads  # query head j reads kv head j // group
        k_rep, v_rep = np.repeat(k_all, group, axis=0), np.repeat(v_all, group, axis=0)
        scores = q.transpose(1, 0, 2) @ k_rep.transpose(0, 2, 1) / np.sqrt(hd)  # [heads, n, t]
        key_pos = np.arange(k_all.shape[1])
        scores = np.where(key_pos[None, None, :] <= positions[None, :, None], scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = (scores / scores.sum(axis=-1, keepdims=True)).astype(np.float32)
        out = (probs @ v_rep).transpose(1, 0, 2).reshape(n, cfg.num_heads * hd)
        return linear(out, layer.wo), (k_all, v_all)


def greedy(model, prompt, steps, ignore_eos):
    cache = model.new_cache()
    logits = model.forward(prompt, cache)
    generated = []
    for _ in range(steps):
        token_id = int(np.argmax(logits[-1]))
        generated.append(token_id)
        if token_id in model.cfg.eos_ids and not ignore_eos:
            break
        logits = model.forward([token_id], cache)
    return generated


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="path to a .gguf file (llama or qwen2)")
    ap.add_argument("--tokens-file", required=True, help="JSON list of token ids")
    ap.add_argument("--mode", choices=("logits", "greedy", "embedding"), required=True)
    ap.add_argument("--out", help="logits mode: write float32 [n, vocab] logits here (.npy)")
    ap.add_argument("--top1-out", help="logits mode: write int64 [n] argmax per position here (.npy)")
    ap.add_argument("--steps", type=int, default=32, help="greedy mode: tokens to generate at most")
    ap.add_argument("--ignore-eos", action="store_true", help="greedy mode: do not stop at eos")
    args = ap.parse_args()

    with open(args.tokens_file) as f:
        token_ids = [int(t) for t in json.load(f)]
    if not token_ids:
        sys.exit("empty token list")
    if args.mode == "embedding" and not args.out:
        sys.exit("embedding mode needs --out")
    if args.mode == "logits" and not (args.out or args.top1_out):
        sys.exit("logits mode needs --out and/or --top1-out")

    t0 = time.perf_counter()
    model = Model(args.model)
    t1 = time.perf_counter()
    print(f"loaded {args.model} ({model.cfg.arch}) in {t1 - t0:.1f}s", file=sys.stderr)

    if args.mode == "logits":
        logits = model.forward(token_ids, model.new_cache()).astype(np.float32)
        if args.out:
            np.save(args.out, logits)
        if args.top1_out:
            np.save(args.top1_out, np.argmax(logits, axis=-1).astype(np.int64))
    elif args.mode == "embedding":
        h = model.hidden(token_ids, model.new_cache()).astype(np.float64)
        pooled = np.stack([h.mean(axis=0), h[-1]])
        np.save(args.out, (pooled / np.linalg.norm(pooled, axis=1, keepdims=True)).astype(np.float32))
    else:
        print(json.dumps(greedy(model, token_ids, args.steps, args.ignore_eos)))
    t2 = time.perf_counter()
    print(f"{args.mode}: {len(token_ids)} prompt tokens in {t2 - t1:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
