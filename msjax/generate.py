"""Text generation: batched prompts, a KV cache, greedy or sampled decoding, on any mesh.

    run = load_run("runs/gpt_tiny")                             # newest verified checkpoint, its config and tokenizer
    results = generate_text(run, ["To be, or not"], max_new_tokens=50, temperature=0.8, top_k=40)
    ids = Generator(cfg.model, graphdef, params).generate([[1, 2, 3]], max_new_tokens=8)   # token ids in, ids out

Decoding with the cache (default) runs the prompts once (prefill: a batch of prompts of different lengths,
right-padded, in one forward pass that also fills the cache), then one token per step against the cache
(`msjax.model.GPT.decode`), every step of a chunk inside one compiled `lax.while_loop`, as T5X's and the Flax
lm1b example's `temperature_sample` decode: one call and one host sync per chunk instead of per token, and the
loop ends on the device once every row has produced a stop id. The cache grows a block of CACHE_BLOCK positions
at a time as the longest row reaches it, up to the longest prompt plus the new tokens (`cache_length`), so a
decode step attends over the filled slots rounded up to a block, never model.max_seq_len (one compiled decode
loop per cache size, reused by every later call); with a sliding window it is a ring of at most W slots per layer,
so its memory is O(W), not O(sequence). `cache=False` recomputes the whole sequence for every new token
(the reference the cached path is tested against, and the baseline of scripts/bench_generate.py).

Layouts: the parameters keep the sharding they were restored with (any mesh: `load_run` takes mesh overrides) and
the model's logical axes are laid out by the config's rule set, except that the sequence of the decoded tokens is
never split (one token per step has nothing to split); the batch is split over (data, fsdp), padded with dummy rows
to a multiple of their size.

Positions: a sequence may not be longer than model.max_seq_len (learned positions stop there; RoPE models were
trained up to it). With `rolling=True` generation goes on past it nanoGPT's way: when the context is full, the
last max_seq_len / 2 tokens become the new prompt (their positions start again at 0) and decoding continues.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from msjax.chat import ChatFormat, load_chat_format
from msjax.config import Config, ModelConfig, apply_overrides
from msjax.model import KV_NAMES, KVCache, abstract_model, apply, apply_decode, cache_slots, init_cache
from msjax.parallel.expert import use_expert_parallelism
from msjax.sample import check_sampling, sample_logits
from msjax.sharding import constrain, use_rules
from msjax.sharding_rules import Rules
from msjax.sharding_rules import axes as ax

# Token buffers are padded to a multiple of this many positions (fewer distinct shapes to compile).
PAD_TO = 16
# The KV cache holds a chunk's longest context plus its new tokens, rounded up to a multiple of this many slots
# (capped at model.max_seq_len): each decode step attends over those slots, not over max_seq_len, and the decode
# loop compiles once per multiple reached.
CACHE_BLOCK = 128


def cache_length(longest: int, new: int, max_seq_len: int) -> int:
    """Positions the KV cache of a chunk holds: `longest` context tokens + `new` tokens rounded up to a multiple of
    CACHE_BLOCK, at most `max_seq_len` (with a sliding window the cache is a ring of at most W of them:
    `msjax.model.cache_slots`)."""
    return min(_round_up(longest + new, CACHE_BLOCK), max_seq_len)


def decode_rules(rules: Rules) -> Rules:
    """The rule set for decoding: `rules` with the activations' sequence never split (a decode step has one
    token; Megatron-SP and context parallelism split the sequence of the training step)."""
    return {**rules, ax.ACT_SEQ: None, ax.ACT_SEQ_INNER: None}


class Generator:
    """Compiled decoding of one model on one mesh; reuse it for many calls (each shape compiles once).

    Args:
      model_cfg: the model's config (vocab_size set).
      graphdef: `msjax.model.abstract_model(model_cfg)[0]`.
      params: the parameters (plain nested dict of arrays, sharded or not).
      mesh, rules: the mesh the parameters live on and the rule set that laid them out (None: one device, no
        layout constraints).
    """

    def __init__(self, model_cfg: ModelConfig, graphdef: Any, params: dict, mesh: Mesh | None = None,
                 rules: Rules | None = None):
        if (mesh is None) != (rules is None):
            raise ValueError("Generator: give both mesh and rules, or neither")
        self.cfg, self.graphdef, self.params = model_cfg, graphdef, params
        self.mesh, self.rules = mesh, rules
        self.batch_devices = 1 if mesh is None else math.prod(mesh.shape[a] for a in ax.BATCH_AXES)
        # Uncached forward passes run the training layout, whose sequence may be split over sequence x tensor.
        self.seq_multiple = 1 if mesh is None else mesh.shape[ax.SEQUENCE] * mesh.shape[ax.TENSOR]
        self._replicated = None if mesh is None else NamedSharding(mesh, P())
        sampling = ("temperature", "top_k", "top_p")
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("max_len",) + sampling)
        self._decode = jax.jit(self._decode_fn, static_argnames=("slots",) + sampling)
        self._full_step = jax.jit(self._full_step_fn, static_argnames=sampling, donate_argnames=("buf_bt",))

    # ---- the compiled pieces --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _in_rules(self, rules: Rules | None):
        """The mesh's rules for code traced inside and, for a mixture of experts, expert parallelism (each
        device's tokens to the devices holding their experts, as the training step runs them)."""
        if self.mesh is None:
            yield
            return
        experts = use_expert_parallelism() if self.cfg.moe.num_experts else contextlib.nullcontext()
        with use_rules(self.mesh, rules), experts:
            yield

    def _prefill_fn(self, params, tokens_bt, count_b, key, *, max_len, temperature, top_k, top_p):
        with self._in_rules(None if self.rules is None else decode_rules(self.rules)):
            cache = init_cache(self.cfg, tokens_bt.shape[0], max_len)
            zeros = jnp.zeros_like(count_b)
            logits_btv, cache = apply_decode(self.graphdef, params, tokens_bt, zeros, count_b, cache)
            last_bv = jnp.take_along_axis(logits_btv, (count_b - 1)[:, None, None], axis=1)[:, 0]
            return self._replicate(sample_logits(last_bv, key, temperature, top_k, top_p)), cache

    def _decode_fn(self, params, token_b, pos_b, cache, key, first_step, count, stops_s, done_b, *, slots,
                   temperature, top_k, top_p):
        """Up to `count` tokens after `token_b` (rows at positions `pos_b`), one decode step per iteration of a
        while loop, against `cache` grown first to `slots` slots (empty ones at its end: every position cached so
        far is below its old size, so each keeps its slot); draw i uses fold_in(key, first_step + i). The loop
        ends early once every row is `done_b` or has produced one of `stops_s`. Returns ((B, max_seq_len) int32
        tokens, of which the first `made` columns are the decoded ones; made; the cache; the last token of each
        row; which rows are done)."""
        rows = token_b.shape[0]
        grow = slots - cache.slots
        if grow:
            with self._in_rules(None if self.rules is None else decode_rules(self.rules)):
                pad = ((0, 0), (0, 0), (0, grow), (0, 0), (0, 0))
                names = (None, *KV_NAMES)
                cache = KVCache(constrain(jnp.pad(cache.k, pad), names), constrain(jnp.pad(cache.v, pad), names),
                                jnp.pad(cache.pos, ((0, 0), (0, grow)), constant_values=-1))

        def more(carry):
            i, _, _, _, _, done_b = carry
            return (i < count) & ~jnp.all(done_b)

        def decode_one(carry):
            i, token_b, pos_b, cache, out_bt, done_b = carry
            with self._in_rules(None if self.rules is None else decode_rules(self.rules)):
                logits_btv, cache = apply_decode(self.graphdef, params, token_b[:, None], pos_b,
                                                 jnp.ones_like(pos_b), cache)
                token_b = self._replicate(sample_logits(logits_btv[:, 0], jax.random.fold_in(key, first_step + i),
                                                        temperature, top_k, top_p))
            out_bt = jax.lax.dynamic_update_slice(out_bt, token_b[:, None], (0, i))
            return i + 1, token_b, pos_b + 1, cache, out_bt, done_b | jnp.isin(token_b, stops_s)

        out_bt = jnp.zeros((rows, self.cfg.max_seq_len), jnp.int32)  # a chunk never holds more tokens
        done_b = done_b | jnp.isin(token_b, stops_s)
        made, token_b, _, cache, out_bt, done_b = jax.lax.while_loop(more, decode_one, (jnp.int32(0), token_b, pos_b,
                                                                                     cache, out_bt, done_b))
        return self._replicate(out_bt), made, cache, token_b, done_b

    def _full_step_fn(self, params, buf_bt, pos_b, key, *, temperature, top_k, top_p):
        """Uncached: the whole (padded) sequence again; the token at each row's `pos_b` is sampled and written."""
        with self._in_rules(self.rules):
            logits_btv = apply(self.graphdef, params, buf_bt)
            last_bv = jnp.take_along_axis(logits_btv, (pos_b - 1)[:, None, None], axis=1)[:, 0]
            token_b = self._replicate(sample_logits(last_bv, key, temperature, top_k, top_p))
            rows = jnp.arange(buf_bt.shape[0])
            return token_b, buf_bt.at[rows, pos_b].set(token_b)

    def _replicate(self, x: jax.Array) -> jax.Array:
        """The sampled tokens whole on every device, so every process reads them (`_host`)."""
        return x if self._replicated is None else jax.lax.with_sharding_constraint(x, self._replicated)

    # ---- the loop ------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | jax.Array = 0, cache: bool = True,
                 stop_ids: Sequence[int] = (), rolling: bool = False) -> list[list[int]]:
        """Generates `max_new_tokens` tokens after each prompt.

        Args:
          prompts: token ids per prompt (each at least one id, each < model.vocab_size).
          max_new_tokens: tokens to generate per prompt (>= 1).
          temperature, top_k, top_p: as `msjax.sample` (temperature <= 0: greedy).
          seed: an int, or a jax PRNG key; the draw of step i uses fold_in(key, i), row by row.
          cache: decode against a KV cache (default) or recompute the whole sequence per token.
          stop_ids: a row ends after the first of these it generates (kept in its output); the loop ends early
            when every row has ended.
          rolling: go on past model.max_seq_len (module docstring) instead of raising.
        Returns:
          The generated ids of each prompt (without the prompt).
        Raises:
          ValueError: an empty prompt, an id outside the vocabulary, max_new_tokens < 1, a sampling setting out of
            range, or (without `rolling`) a prompt plus max_new_tokens longer than model.max_seq_len.
        """
        check_sampling(temperature, top_k, top_p)
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            raise ValueError("generate: no prompts")
        if max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens={max_new_tokens}: allowed is an integer >= 1")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} has no tokens; give at least one")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {self.cfg.vocab_size}): "
                                 f"{bad[:5]}")
        limit = self.cfg.max_seq_len
        longest = max(map(len, prompts))
        if not rolling and longest + max_new_tokens > limit:
            raise ValueError(f"a prompt of {longest} tokens + --max_new_tokens={max_new_tokens} = "
                             f"{longest + max_new_tokens} tokens is longer than the model's context "
                             f"(model.max_seq_len={limit}); shorten them, or let the context roll (rolling=True, "
                             "--rolling)")
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        settings = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        n = len(prompts)
        rows = -(-n // self.batch_devices) * self.batch_devices  # dummy one-token rows pad the batch
        contexts = [p[-limit:] for p in prompts] + [[0]] * (rows - n)
        out: list[list[int]] = [[] for _ in range(rows)]
        stopped = np.zeros(rows, bool)
        stops = np.asarray(sorted(set(stop_ids)), np.int64)
        made = 0
        while made < max_new_tokens and not stopped[:n].all():
            room = limit - max(map(len, contexts))
            if room < 1:  # rolling: the last limit // 2 tokens of each row become its new prompt
                contexts = [c[-(limit // 2):] for c in contexts]
                room = limit - max(map(len, contexts))
            chunk = self._chunk(contexts, min(room, max_new_tokens - made), key, made, cache, settings, stops,
                                stopped, n)
            for r in range(rows):
                out[r] += chunk[r]
                contexts[r] = contexts[r] + chunk[r]
            made += len(chunk[0])
        return [_until_stop(o, stops) for o in out[:n]]

    def _chunk(self, contexts: list[list[int]], new: int, key: jax.Array, first_step: int, cache: bool,
               settings: dict, stops: np.ndarray, stopped: np.ndarray, real_rows: int) -> list[list[int]]:
        """Up to `new` tokens after each context (each context + new <= max_seq_len; fewer once every one of the
        first `real_rows` rows has produced a stop id); updates `stopped`."""
        rows = len(contexts)
        lengths = np.array([len(c) for c in contexts], np.int32)
        # Widths rounded up to a multiple of PAD_TO, so prompts of nearby lengths share one compiled program (padding
        # is never attended: it sits after each row's last real token).
        if cache:  # the prompts, right-padded
            width = _round_up(int(lengths.max()), PAD_TO)
        else:  # room for every token of the chunk, in whole sequence shards of the training layout
            width = _round_up(int(lengths.max()) + new, math.lcm(PAD_TO, self.seq_multiple))
        width = min(width, self.cfg.max_seq_len)
        buf = np.zeros((rows, width), np.int32)
        for r, c in enumerate(contexts):
            buf[r, :len(c)] = c
        if cache:
            # The cache grows a block at a time as the longest row's position crosses into it (`_decode`'s
            # `slots`), up to `cache_length`, so every decode step attends over the filled slots rounded up to
            # CACHE_BLOCK; a sliding window's ring stops growing at W slots.
            longest = int(lengths.max())
            final = cache_length(longest, new, self.cfg.max_seq_len)
            size = min(_round_up(longest + 1, CACHE_BLOCK), final)
            token, kv = self._prefill(self.params, self._put(buf), self._put(lengths),
                                      jax.random.fold_in(key, first_step), max_len=size, **settings)
            first, parts = token, []  # (rows, 1) the prefill's token, then each segment's
            done = self._put(stopped | (np.arange(rows) >= real_rows))  # dummy rows never hold the loop up
            stops_dev, pos, step = self._put(stops.astype(np.int32)), lengths.copy(), 1
            while step < new:  # one host sync per segment: its count of tokens decides the next one's start
                count = min(new - step, size - (longest + step - 1))  # the longest row's positions stay < size
                out, made, kv, token, done = self._decode(
                    self.params, token, self._put(pos), kv, key, np.int32(first_step + step), np.int32(count),
                    stops_dev, done, slots=cache_slots(self.cfg, size), **settings)
                if not parts:  # read once the first segment is queued behind it: the device goes straight on
                    parts.append(_host(first)[:, None])
                made = int(_host(made))
                parts.append(_host(out)[:, :made])
                step, pos = step + made, pos + made
                if made < count:  # every row has stopped
                    break
                size = min(size + CACHE_BLOCK, final)
            ids = np.concatenate(parts or [_host(first)[:, None]], axis=1)
        else:
            tokens: list[jax.Array] = []
            buf_dev, pos = self._put(buf), self._put(lengths)
            seen = stopped.copy()
            for i in range(new):
                if i and stops.size:  # a host sync per token: this path is the reference, not the fast one
                    seen |= np.isin(_host(tokens[-1]), stops)
                    if seen[:real_rows].all():
                        break
                token, buf_dev = self._full_step(self.params, buf_dev, pos, jax.random.fold_in(key, first_step + i),
                                                 **settings)
                pos = pos + 1
                tokens.append(token)
            ids = np.stack([_host(t) for t in tokens], axis=1)  # (rows, made)
        if stops.size:
            stopped |= np.isin(ids, stops).any(axis=1)
        return [row.tolist() for row in ids]

    def _put(self, x: np.ndarray) -> jax.Array:
        """Host values (the same on every process) as an array whole on every device of the mesh."""
        if self._replicated is None:
            return jnp.asarray(x)
        return jax.make_array_from_callback(x.shape, self._replicated, lambda index: x[index])


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _host(x: jax.Array) -> np.ndarray:
    """A replicated array's value on this process (in a multi-process run it spans devices this process does
    not own; any local copy is the whole value)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def _until_stop(ids: list[int], stops: np.ndarray) -> list[int]:
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i + 1]
    return ids


# ---------------------------------------------------------------------------------------------------------------
# From a run directory.


@dataclass
class LoadedRun:
    """A run's newest verified checkpoint, ready to generate from.

    Attributes:
      config: the run's config (with any overrides given to `load_run`).
      step: the checkpoint's step.
      generator: a Generator on the config's mesh.
      tokenizer: the run's tokenizer (`<run_dir>/tokenizer.json`), or None when the run has none.
      run_dir: the run directory.
      chat: its chat template, stop ids and sampling defaults (`msjax.chat.load_chat_format`).
    """

    config: Config
    step: int
    generator: Generator
    tokenizer: Any
    run_dir: Path
    chat: ChatFormat = ChatFormat()


def load_run(run_dir: str | Path, overrides: dict[str, Any] | None = None, config: Config | None = None,
             devices: Sequence[jax.Device] | None = None, dtype: str | None = None) -> LoadedRun:
    """Restores the parameters of a run's newest verified checkpoint onto a mesh, for generation (only the
    parameters are read: `msjax.runs.restore_params`).

    Args:
      run_dir: a run directory (config.json, checkpoints/, tokenizer.json), from training or
        `scripts/convert.py --from_hf`.
      overrides: dotted config keys applied to the run's config, e.g. {"mesh.tensor": 2, "mesh.data": 1}: the
        parameters are restored onto that mesh (any mesh the devices allow).
      config: the config to use instead of `<run_dir>/config.json` (+ overrides).
      devices: the devices of the mesh (default: all).
      dtype: "float32" or "bfloat16": the parameters, activations and KV cache in that dtype (model.param_dtype
        and model.dtype of the returned config); None: as the run trained.
    Raises:
      ConfigError: no config.json, a config or mesh that does not fit the devices, a dtype not allowed.
      msjax.checkpoint.CheckpointError: no checkpoint passes verification.
    """
    from msjax.data import load_tokenizer
    from msjax.runs import restore_params, run_config

    run_dir = Path(run_dir)
    cfg = run_config(run_dir, overrides) if config is None else apply_overrides(config, overrides or {}).validate()
    program, step, params = restore_params(run_dir, cfg, devices, dtype)
    config, graphdef = program.config, program.graphdef
    if dtype is not None and (config.model.param_dtype, config.model.dtype) != (dtype, dtype):
        config = replace(config, model=replace(config.model, param_dtype=dtype, dtype=dtype))
        graphdef = abstract_model(config.model)[0]
    tok_path = run_dir / "tokenizer.json"
    tokenizer = load_tokenizer(tok_path) if tok_path.is_file() else None
    chat = load_chat_format(run_dir, tokenizer) if tokenizer is not None else ChatFormat()
    generator = Generator(config.model, graphdef, params, program.mesh, program.layout.rules)
    return LoadedRun(config, step, generator, tokenizer, run_dir, chat)


@dataclass
class Completion:
    """One prompt's generation: what `scripts/generate.py --json` writes per prompt."""

    prompt: str
    prompt_ids: list[int]
    generated_ids: list[int]
    text: str


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A prompt's ids with the tokenizer's own special tokens (a Hugging Face tokenizer.json's post-processor,
    e.g. Llama's begin-of-text; none for msjax's own tokenizers), as `transformers`' tokenizer(text) gives."""
    from msjax.data import HFTokenizer

    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode(text, add_special_tokens=True).tolist()
    return tokenizer.encode(text).tolist()


# Sampling when neither the caller nor the run's generation_config.json says otherwise.
DEFAULT_SAMPLING = {"temperature": 0.8, "top_k": 0, "top_p": 1.0}


def sampling_settings(run: LoadedRun, temperature: float | None = None, top_k: int | None = None,
                      top_p: float | None = None) -> dict[str, float]:
    """{"temperature", "top_k", "top_p"}: each one given, else the run's generation_config.json's
    (`ChatFormat.sampling`), else DEFAULT_SAMPLING's."""
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    return {k: v if v is not None else run.chat.sampling.get(k, DEFAULT_SAMPLING[k]) for k, v in given.items()}


def generate_text(run: LoadedRun, prompts: Sequence[str | Sequence[dict]], max_new_tokens: int, *,
                  temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                  seed: int = 0, cache: bool = True, stop_at_eot: bool = True, rolling: bool = False,
                  chat: bool = False) -> list[Completion]:
    """Encodes `prompts` with the run's tokenizer, generates (`Generator.generate`) and decodes.

    Args:
      run: from `load_run`.
      prompts: texts; with `chat`, a text (one user turn) or a conversation ([{"role", "content"}, ...]) each,
        rendered by the run's chat template with the assistant's turn opened (`msjax.chat.ChatFormat`).
      max_new_tokens, seed, cache, rolling: as `Generator.generate`.
      temperature, top_k, top_p: None takes the run's generation_config.json's (`sampling_settings`).
      stop_at_eot: end a row at one of the run's stop ids (`ChatFormat.stop_ids`: generation_config.json's
        eos_token_id, else the tokenizer's end-of-text), kept out of the text.
      chat: apply the chat template.
    Raises:
      ValueError: the run has no tokenizer, or as `Generator.generate`.
      ConfigError: `chat` on a run without a chat template, or a conversation `msjax.chat.check_messages` refuses.
    """
    tok = run.tokenizer
    if tok is None:
        raise ValueError(f"{run.run_dir} has no tokenizer.json: give token ids to Generator.generate instead")
    if chat:
        ids = [run.chat.encode(tok, [{"role": "user", "content": p}] if isinstance(p, str) else list(p))
               for p in prompts]
    else:
        ids = [encode_prompt(tok, p) for p in prompts]
    stops = list(run.chat.stop_ids) if stop_at_eot else []
    out = run.generator.generate(ids, max_new_tokens, **sampling_settings(run, temperature, top_k, top_p),
                                 seed=seed, cache=cache, stop_ids=stops, rolling=rolling)
    results = []
    for prompt, p_ids, g_ids in zip(prompts, ids, out):
        shown = g_ids[:-1] if stops and g_ids and g_ids[-1] in stops else g_ids
        text = prompt if isinstance(prompt, str) else json.dumps(list(prompt), ensure_ascii=False)
        results.append(Completion(text, p_ids, g_ids, tok.decode(shown)))
    return results


def generate(model_cfg: ModelConfig, graphdef: Any, params: dict, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, **kwargs: Any) -> list[list[int]]:
    """`Generator(model_cfg, graphdef, params).generate(prompts, max_new_tokens, **kwargs)` on one device (no
    mesh); see `Generator.generate`."""
    return Generator(model_cfg, graphdef, params).generate(prompts, max_new_tokens, **kwargs)
