"""Online serving on a simulated GPU clock: the PagedAttention paper's OPT-13B on one A100-40GB.

Four systems step on one virtual clock whose step time is a stated roofline model
(`StepTimeModel`): paged (the real Scheduler + KVCacheManager, driven model-free as
sim.run_paged drives them), Orca (Oracle / Pow2 / Max: contiguous reservations placed by
the buddy allocator, iteration-level batching) and a FasterTransformer-style static batch.
baselines.serving's online driver hands them Poisson arrivals on that clock, so latency
is what a client would see on the modelled GPU. Host code only: no jax, no model.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import numpy as np

from paged_jax.baselines.serving import (
    poisson_arrivals,
    request_seed,
    run_metrics,
    serve_online,
    serve_unloaded,
)
from paged_jax.baselines.workload import TraceRequest
from paged_jax.beam_search import BeamSearch, BeamSearchParams
from paged_jax.config import EngineConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus
from paged_jax.core.scheduler import Scheduler
from paged_jax.memory_study.allocators import (
    POLICIES,
    BuddySpace,
    reservation_size,
    static_batch_size,
)
from paged_jax.memory_study.forks import BeamModel
from paged_jax.memory_study.workloads import DATASETS, VOCAB_SIZE
from paged_jax.sampling_params import SamplingParams

# ------------------------------------------------------------------ the modelled setting
# OPT-13B, from its Hugging Face config.json (facebook/opt-13b): hidden_size 5120,
# num_hidden_layers 40, ffn_dim 20480, vocab_size 50272, max_position_embeddings 2048
# (the learned position table has 2 extra rows), torch_dtype float16.
OPT13B = {
    "hidden_size": 5120,
    "num_layers": 40,
    "ffn_dim": 20480,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "dtype_bytes": 2,
}
# NVIDIA A100 Tensor Core GPU datasheet, A100 40GB (SXM4): HBM2 bandwidth 1,555 GB/s;
# FP16 Tensor Core peak 312 TFLOPS (dense; 624 is with structured sparsity).
A100_40GB_HBM_BYTES_PER_S = 1.555e12
A100_40GB_FP16_FLOPS_PER_S = 312e12
# An assumption, not a measurement: the per-step cost outside the roofline (kernel
# launches, the host's scheduling and input preparation, sampling). The sensitivity rows
# of scripts/sim_serving.py halve and double it.
STEP_OVERHEAD_S = 5e-3
# The paper's Table 1: OPT-13B on one A100-40GB leaves 12 GB for the KV cache, "15.7K"
# token slots; 12 GiB / 800 KiB per token = 15,728.6, i.e. 983 blocks of 16 (15,728 slots).
KV_BUDGET_BYTES = 12 * 2**30
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
# The scheduler's caps, the same for paged and Orca: vLLM's defaults of the paper's time
# (max_num_seqs 256) and a per-step token budget of one full-length sequence.
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class StepTimeModel:
    """Step time of a decoder-only transformer on one GPU, a roofline plus an overhead.

        time = max(bytes / hbm_bytes_per_s, flops / peak_flops_per_s) + overhead_s
        bytes = weight_bytes + kv_bytes_per_token * (context of every scheduled sequence,
                this step's tokens included: read by attention, the new ones also written)
        flops = 2 * matmul_params * new tokens                (every linear layer)
              + 2 * hidden * vocab * sampled rows             (the tied LM head)
              + 4 * layers * hidden * attended (query, key) pairs   (QK^T and PV)

    The max, not the sum: within a step the weight stream and the tensor-core work
    overlap (each GEMM is bound by one of them), so the slower of the two sets the time;
    the sum would charge a decode step twice for the same weight reads. Prefill tokens
    enter as FLOPs; decode is bandwidth-bound until a step carries ~200 tokens.

    Args:
        hidden_size, num_layers, ffn_dim, vocab_size, max_position_embeddings: the
            model's shape (defaults: OPT-13B).
        dtype_bytes: bytes per weight and per KV element.
        hbm_bytes_per_s: peak memory bandwidth (default: A100-40GB).
        peak_flops_per_s: peak dense fp16 FLOPs (default: A100-40GB).
        overhead_s: fixed cost added to every step (an assumption, see STEP_OVERHEAD_S).
    """

    hidden_size: int = OPT13B["hidden_size"]
    num_layers: int = OPT13B["num_layers"]
    ffn_dim: int = OPT13B["ffn_dim"]
    vocab_size: int = OPT13B["vocab_size"]
    max_position_embeddings: int = OPT13B["max_position_embeddings"]
    dtype_bytes: int = OPT13B["dtype_bytes"]
    hbm_bytes_per_s: float = A100_40GB_HBM_BYTES_PER_S
    peak_flops_per_s: float = A100_40GB_FP16_FLOPS_PER_S
    overhead_s: float = STEP_OVERHEAD_S

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "ffn_dim", "vocab_size", "dtype_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"StepTimeModel.{name}={value!r} must be an int >= 1")
        for name in ("hbm_bytes_per_s", "peak_flops_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"StepTimeModel.{name}={value!r} must be a finite number > 0")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ValueError(f"StepTimeModel.overhead_s={self.overhead_s!r} must be >= 0")

    @property
    def matmul_params(self) -> int:
        """Weights of the layers' linear maps (q, k, v, out: 4 h^2; fc1, fc2: 2 h f)."""
        h = self.hidden_size
        return self.num_layers * (4 * h * h + 2 * h * self.ffn_dim)

    @property
    def num_params(self) -> int:
        """Every parameter: linear weights and biases, layer norms, the (tied) token
        embedding and the learned positions (OPT offsets them by 2 rows)."""
        h, f = self.hidden_size, self.ffn_dim
        per_layer_small = 4 * h + f + h + 2 * 2 * h  # biases of q,k,v,out, fc1, fc2; 2 LNs
        return (
            self.matmul_params
            + self.num_layers * per_layer_small
            + 2 * h  # final layer norm
            + self.vocab_size * h
            + (self.max_position_embeddings + 2) * h
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights every step streams from HBM (all parameters once)."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 * layers * hidden * dtype bytes."""
        return 2 * self.num_layers * self.hidden_size * self.dtype_bytes

    def step_time(
        self, num_new_tokens: int, num_kv_tokens: int, num_attn_pairs: int, num_sampled: int
    ) -> float:
        """Seconds of one step.

        Args:
            num_new_tokens: tokens the step computes (prefill chunks + one per decode).
            num_kv_tokens: K/V entries the step touches: each scheduled sequence's
                context including its new tokens.
            num_attn_pairs: (query token, key) pairs attention scores.
            num_sampled: rows that reach the LM head (one per sequence that samples).
        """
        nbytes = self.weight_bytes + self.kv_bytes_per_token * num_kv_tokens
        h = self.hidden_size
        flops = (
            2 * self.matmul_params * num_new_tokens
            + 2 * h * self.vocab_size * num_sampled
            + 4 * self.num_layers * h * num_attn_pairs
        )
        return max(nbytes / self.hbm_bytes_per_s, flops / self.peak_flops_per_s) + self.overhead_s

    def constants(self) -> dict[str, Any]:
        """Every input and derived constant, for the JSON report."""
        return {
            **dataclasses.asdict(self),
            "num_params": self.num_params,
            "matmul_params": self.matmul_params,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


def kv_budget_tokens(model: StepTimeModel, block_size: int = BLOCK_SIZE) -> int:
    """The paper's KV budget in token slots, whole blocks: 12 GiB over the KV bytes per token."""
    return KV_BUDGET_BYTES // model.kv_bytes_per_token // block_size * block_size


class StepCost:
    """Sums one step's sequences for StepTimeModel.step_time."""

    __slots__ = ("new", "kv", "pairs", "sampled")

    def __init__(self) -> None:
        self.new = self.kv = self.pairs = self.sampled = 0

    def add(self, num_computed: int, num_new: int, samples: bool, rows: int = 1) -> None:
        """`rows` equal sequences with num_computed tokens in KV each computing num_new."""
        self.new += rows * num_new
        self.kv += rows * (num_computed + num_new)
        self.pairs += rows * (num_new * num_computed + num_new * (num_new + 1) // 2)
        self.sampled += rows * bool(samples)

    def time(self, model: StepTimeModel) -> float:
        return model.step_time(self.new, self.kv, self.pairs, self.sampled)


class VirtualClock:
    """The simulated time: systems advance it by their step times, the driver's sleep by
    the wait for the next arrival."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "time runs forward: a negative step or sleep is a bug"
        self.now += seconds

    sleep = advance


# ------------------------------------------------------------------ the four systems
class _SimServer:
    """What the simulated systems share: the clock, the cost model, the batch tally."""

    def __init__(self, model: StepTimeModel, clock: VirtualClock) -> None:
        self.model, self.clock = model, clock
        self.busy_s = 0.0
        self.batch_seconds = 0.0  # sum of batch size x step time
        self.num_steps = 0

    def _tick(self, cost: StepCost, batch_size: int) -> None:
        dt = cost.time(self.model)
        self.clock.advance(dt)
        self.busy_s += dt
        self.batch_seconds += batch_size * dt
        self.num_steps += 1

    def extra(self) -> dict[str, Any]:
        return {
            "busy_s": self.busy_s,
            "time_avg_batch_size": self.batch_seconds / self.busy_s if self.busy_s else 0.0,
        }


class PagedSim(_SimServer):
    """The paged design: the project's Scheduler and KVCacheManager at the KV budget.

    Each step is schedule() -> its cost on the clock -> a dummy token for every sequence
    that reached the end of its known tokens -> update_from_output() (as sim.run_paged).
    Prefix caching is off (the paper's basic-sampling runs share nothing) and a
    preempted request is recomputed, so a preemption costs its prefill again.
    """

    def __init__(
        self,
        model: StepTimeModel,
        clock: VirtualClock,
        *,
        budget_tokens: int,
        block_size: int = BLOCK_SIZE,
        max_model_len: int = MAX_MODEL_LEN,
        max_num_seqs: int = MAX_NUM_SEQS,
        max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    ) -> None:
        super().__init__(model, clock)
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        # Blocks per step, summed: pointed at by the running sequences' tables (what
        # they would hold unshared) and held by the pool (a shared block once).
        self.block_steps = {"logical": 0, "physical": 0, "peak_physical": 0}
        num_blocks = budget_tokens // block_size + 1  # + the null block
        config = EngineConfig(
            block_size=block_size,
            num_kv_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
            preemption_mode="recompute",
            scheduling_policy="fcfs",
        )
        self.kv = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=False, max_model_len=max_model_len
        )
        self.sched = Scheduler(config, self.kv)

    def add(self, req: TraceRequest) -> None:
        params = SamplingParams(max_tokens=req.num_output_tokens, temperature=0.0, ignore_eos=True)
        self.sched.add_request(
            Request(req.request_id, req.prompt_token_ids, params, arrival_time=self.clock.now)
        )

    def step(self) -> list[tuple[str, list[int]]]:
        sched = self.sched
        out = sched.schedule()
        assert not out.errored, f"a request can never fit the pool: {out.errored}"
        cost = StepCost()
        sampled = {}
        for seq in out.scheduled:
            cost.add(seq.num_computed_tokens, seq.num_new_tokens, seq.samples)
            if seq.samples:
                sampled[seq.req_id] = 3 + seq.num_output_tokens % (VOCAB_SIZE - 3)
        self._tick(cost, self.num_running)
        self._count_blocks()
        finished = sched.update_from_output(out, sampled)
        return self._after_step(list(sampled), finished)

    def _count_blocks(self) -> None:
        kv = self.kv
        physical = kv.num_usable_blocks - kv.num_free_blocks
        self.block_steps["logical"] += sum(kv.get_num_blocks(r) for r in self.sched.running)
        self.block_steps["physical"] += physical
        self.block_steps["peak_physical"] = max(self.block_steps["peak_physical"], physical)

    def _after_step(
        self, sampled: list[str], finished: list[Request]
    ) -> list[tuple[str, list[Any]]]:
        """What the driver gets back after a step, given the engine requests that sampled
        (in schedule order) and those the scheduler finished; PagedForkSim forks here."""
        return [(r.request_id, r.output_token_ids) for r in finished]

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    def extra(self) -> dict[str, Any]:
        b = self.block_steps
        return {
            **super().extra(),
            "num_preemptions": self.sched.num_preemptions,
            "mean_physical_blocks": b["physical"] / max(1, self.num_steps),
            "peak_physical_blocks": b["peak_physical"],
            "blocks_saved_by_sharing": 1 - b["physical"] / b["logical"] if b["logical"] else 0.0,
        }


FORK_MODES = ("basic", "parallel", "beam")
# The beams' synthetic next-token model: forks.py's default (mean top-1 probability ~0.4).
BEAM_MODEL = BeamModel()


@dataclasses.dataclass
class _Group:
    """One trace request served as several engine requests (its carrier, samples or beams)."""

    req: TraceRequest
    rids: list[str]  # the live engine requests, in sample / beam order
    search: BeamSearch | None = None
    rng: np.random.Generator | None = None
    ready: set[str] = dataclasses.field(default_factory=set)  # beams sampled since a search step
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # finished samples
    step: int = 0


class PagedForkSim(PagedSim):
    """The paged design serving each request as `width` sequences that share blocks.

    * "parallel" (parallel sampling, n = width): the prompt is prefilled once by a
      carrier request; when it samples, `width` children fork it through
      Scheduler.fork_request (every prompt block shared by ref count, the partial last
      one copied on the child's first write) and the carrier is aborted. Each sample
      generates the trace's output length (no EOS, as the engine's ParallelSamplingServer).
    * "beam" (beam search, width beams): paged_jax.beam_search.BeamSearch (HF semantics,
      no EOS, exactly the output length) picks the beams from forks.BeamModel's synthetic
      candidate_rows (a generator seeded per request, so a request's genealogy is the same at
      every rate); once every beam of a search has sampled, losers are aborted (their
      blocks freed) and each survivor forks its parent, sharing the prompt and all common
      generated blocks. A parent preempted meanwhile is recomputed: its children enter as
      new requests with their whole token list as the prompt. When a preemption splits a
      search, its running beams are re-queued too (see _hold_back); a beam that sampled
      may still run a step or two ahead (dummy tokens, charged on the clock) while a
      sibling finishes its prefill chunks.

    A request is returned, with one token list per sample / beam, when all of them are
    done, so its normalized latency divides by one sequence's length (the driver's
    num_output_tokens). At most (max_num_seqs - 1) // width requests are started at once
    (a fork needs a free row); later ones wait in arrival order.
    """

    def __init__(
        self,
        model: StepTimeModel,
        clock: VirtualClock,
        mode: str,
        width: int,
        *,
        budget_tokens: int,
        beam_model: BeamModel = BEAM_MODEL,
        seed: int = 0,
        **caps: int,
    ) -> None:
        if mode not in FORK_MODES[1:]:
            raise ValueError(f"mode={mode!r} must be one of {FORK_MODES[1:]}")
        if not (isinstance(width, int) and width >= 1):
            raise ValueError(f"width={width!r} must be an int >= 1 (samples or beams)")
        super().__init__(model, clock, budget_tokens=budget_tokens, **caps)
        self.mode, self.width, self.beam_model, self.seed = mode, width, beam_model, seed
        self.max_groups = max(1, (self.max_num_seqs - 1) // width)
        self.pending: collections.deque[TraceRequest] = collections.deque()
        self.groups: dict[str, _Group] = {}
        self.owner: dict[str, str] = {}  # engine request id -> trace request id
        self.carriers: dict[str, str] = {}  # parallel: prefill request id -> trace request id
        self.num_held_back = 0  # beams re-queued by _hold_back

    def add(self, req: TraceRequest) -> None:
        if req.num_prompt_tokens + req.num_output_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.request_id!r} needs {req.num_prompt_tokens} + "
                f"{req.num_output_tokens} tokens: must be <= max_model_len={self.max_model_len}"
            )
        self.pending.append(req)
        self._start_pending()

    def _params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def _start_pending(self) -> None:
        while self.pending and len(self.groups) < self.max_groups:
            req = self.pending.popleft()
            prompt = list(req.prompt_token_ids)
            rid = f"{req.request_id}#0"
            if self.mode == "parallel":
                params = self._params(2)  # forked after its first sample, never finishes
                self.carriers[rid] = req.request_id
                group = _Group(req, [])
            else:
                params = self._params(self.max_model_len - len(prompt))
                search = BeamSearch(
                    len(prompt),
                    BeamSearchParams(self.width, 1, ignore_eos=True),
                    (),
                    max_tokens=req.num_output_tokens,
                )
                rng = np.random.default_rng([self.seed, request_seed(req.request_id)])
                group = _Group(req, [rid], search, rng)
                self.owner[rid] = req.request_id
            self.sched.add_request(Request(rid, prompt, params, arrival_time=self.clock.now))
            self.groups[req.request_id] = group

    def _end(self, rid: str) -> None:
        self.owner.pop(rid, None)
        if rid in self.sched.requests:
            self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    def _after_step(
        self, sampled: list[str], finished: list[Request]
    ) -> list[tuple[str, list[Any]]]:
        done = self._parallel(sampled, finished) if self.mode == "parallel" else self._beam(sampled)
        self._start_pending()
        return done

    def _parallel(self, sampled: list[str], finished: list[Request]) -> list[tuple[str, list]]:
        done = []
        for r in finished:
            gid = self.owner.pop(r.request_id)
            group = self.groups[gid]
            group.outputs[r.request_id] = list(r.output_token_ids)
            if len(group.outputs) == self.width:
                done.append((gid, [group.outputs[rid] for rid in group.rids]))
                del self.groups[gid]
        for rid in sampled:
            gid = self.carriers.pop(rid, None)
            if gid is None:
                continue
            group = self.groups[gid]
            out_len = group.req.num_output_tokens
            carrier = self.sched.requests[rid]
            if out_len == 1:  # the prefill's sample was the whole output
                done.append((gid, [list(carrier.output_token_ids)] * self.width))
                del self.groups[gid]
            else:
                for j in range(self.width):
                    child = carrier.fork(f"{gid}#s{j}", sampling_params=self._params(out_len))
                    self.sched.fork_request(rid, child)
                    self.owner[child.request_id] = gid
                    group.rids.append(child.request_id)
            self._end(rid)
        return done

    def _beam(self, sampled: list[str]) -> list[tuple[str, list]]:
        touched = {}
        for rid in sampled:
            gid = self.owner.get(rid)
            if gid is not None:
                self.groups[gid].ready.add(rid)
                touched[gid] = None
        done = []
        for gid in touched:  # in schedule order: deterministic
            group = self.groups[gid]
            if not all(rid in group.ready for rid in group.rids):
                self._hold_back(group)
            elif self._advance(gid, group):
                beams = group.search.results(list(group.req.prompt_token_ids), lambda _: "")
                done.append((gid, [b.output_token_ids for b in beams.sequences]))
                del self.groups[gid]
        return done

    def _hold_back(self, group: _Group) -> None:
        """A search split by a preemption (a beam waiting while its siblings run) would let
        the sampled siblings run ahead on dummy tokens, holding blocks the waiting beam
        needs. The group is recomputed as a whole instead (vLLM's unit of preemption is the
        sequence group): each sampled sibling still running is aborted and re-queued with
        its beam's tokens as the prompt."""
        reqs = [self.sched.requests.get(rid) for rid in group.rids]
        if all(r is not None and r.status == RequestStatus.RUNNING for r in reqs):
            return  # a sibling is still in its prefill chunks: it samples soon
        prompt = list(group.req.prompt_token_ids)
        for rid, req, beam in zip(group.rids, reqs, group.search.running, strict=True):
            if rid in group.ready and req is not None and req.status == RequestStatus.RUNNING:
                full = prompt + beam.tokens
                self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                self.sched.add_request(
                    Request(rid, full, self._params(self.max_model_len - len(full)),
                            arrival_time=req.arrival_time)
                )  # fmt: skip
                group.ready.discard(rid)
                self.num_held_back += 1

    def _advance(self, gid: str, group: _Group) -> bool:
        """One search step: losers aborted, survivors forked; True when the search ended."""
        search = group.search
        parents = group.rids
        k = search.num_candidates
        beams = search.step(self.beam_model.candidate_rows(group.rng, len(parents), k))
        group.step += 1
        group.ready = set()
        if search.done:
            for rid in parents:
                self._end(rid)
            return True
        children: dict[int, list[int]] = {}
        for j, beam in enumerate(beams):
            children.setdefault(beam.parent, []).append(j)
        for b, rid in enumerate(parents):
            if b not in children:
                self._end(rid)  # a pruned beam frees its blocks now
        prompt = list(group.req.prompt_token_ids)
        new = [""] * len(beams)
        for b, js in children.items():
            rid = parents[b]
            parent = self.sched.requests.get(rid)
            for j in js:
                cid = f"{gid}#{group.step}-{j}"
                full = prompt + beams[j].tokens
                if parent is not None and parent.status == RequestStatus.RUNNING:
                    # The parent's prompt may hold beam tokens (a recomputed beam); its
                    # sampling params (max_tokens up to max_model_len) carry over.
                    child = parent.fork(cid, full[parent.num_prompt_tokens :])
                    # Shared: the parent's computed tokens the child also has (not its new
                    # last token, nor dummy tokens the parent ran ahead with).
                    shared = min(parent.num_computed_tokens, len(full) - 1)
                    self.sched.fork_request(rid, child, num_tokens=shared)
                else:  # the parent was preempted: recompute the beam
                    self.sched.add_request(
                        Request(cid, full, self._params(self.max_model_len - len(full)),
                                arrival_time=self.clock.now)
                    )  # fmt: skip
                self.owner[cid] = gid
                new[j] = cid
            self._end(rid)
        group.rids = new
        return False

    def has_unfinished(self) -> bool:
        return bool(self.groups or self.pending)

    @property
    def num_running(self) -> int:
        """Trace requests started (each `width` sequences once past its prefill)."""
        return len(self.groups)

    def extra(self) -> dict[str, Any]:
        return {**super().extra(), "num_beams_held_back": self.num_held_back}


@dataclasses.dataclass
class _Seq:
    req: TraceRequest
    starts: list[int]  # one reservation per sample / beam
    num_tokens: int  # known tokens of each row: prompt + sampled
    num_computed: int = 0
    num_output: int = 0
    rows: int = 1  # sequences computing: 1 for the prompt, then one per sample / beam


class OrcaSim(_SimServer):
    """Orca: iteration-level batching over contiguous KV reservations in a buddy allocator.

    A request is admitted (FCFS, head-of-line blocking) once the buddy allocator places
    its reservation (policy "oracle": prompt + output; "pow2": prompt + the output
    rounded up to a power of two; "max": max_model_len); it keeps the chunk until it
    finishes, so it never grows and is never preempted. Each step: running requests
    first (one decode token or the next prefill chunk), then admission, within
    max_num_seqs and max_num_batched_tokens, as the paged scheduler.

    With copies = n (parallel sampling's n samples or beam search's n beams) a request
    holds n such reservations, admitted only when all n fit (Orca shares nothing); its
    prompt is computed once, then n rows decode, each reading its own context (a beam
    search's reshuffling of beams copies K/V between reservations, not charged). It
    returns n token lists; max_num_seqs then counts rows.
    """

    def __init__(
        self,
        model: StepTimeModel,
        clock: VirtualClock,
        policy: str,
        *,
        budget_tokens: int,
        max_model_len: int = MAX_MODEL_LEN,
        max_num_seqs: int = MAX_NUM_SEQS,
        max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
        copies: int = 1,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
        if not (isinstance(copies, int) and 1 <= copies <= max_num_seqs):
            raise ValueError(f"copies={copies!r} must be an int in [1, max_num_seqs]")
        super().__init__(model, clock)
        self.policy, self.max_model_len, self.copies = policy, max_model_len, copies
        self.reserved_steps = 0  # reserved slots summed over steps
        self.peak_reserved = 0
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.space = BuddySpace(budget_tokens)
        start = self.space.alloc(max_model_len)
        if start is None:
            raise ValueError(
                f"budget_tokens={budget_tokens!r} must hold one max_model_len={max_model_len}"
                " buddy block"
            )
        self.space.free(start)
        self.waiting: collections.deque[TraceRequest] = collections.deque()
        self.running: list[_Seq] = []

    def reservation(self, req: TraceRequest) -> int:
        kv_len = req.num_prompt_tokens + req.num_output_tokens - 1
        return reservation_size(
            self.policy, kv_len, self.max_model_len, output_len=req.num_output_tokens
        )

    def add(self, req: TraceRequest) -> None:
        if req.num_prompt_tokens + req.num_output_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.request_id!r} needs {req.num_prompt_tokens} + "
                f"{req.num_output_tokens} tokens: must be <= max_model_len={self.max_model_len}"
            )
        self.waiting.append(req)

    def step(self) -> list[tuple[str, list[int]]]:
        budget = self.max_num_batched_tokens
        cost = StepCost()
        scheduled: list[_Seq] = []
        for seq in self.running:
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed, budget // seq.rows)
            if n == 0:
                continue  # its rows do not fit this step's token budget
            cost.add(seq.num_computed, n, seq.num_computed + n >= seq.num_tokens, rows=seq.rows)
            seq.num_computed += n
            budget -= seq.rows * n
            scheduled.append(seq)
        rows = len(self.running) * self.copies  # the running requests' rows (at most)
        while self.waiting and budget > 0 and rows + self.copies <= self.max_num_seqs:
            req = self.waiting[0]
            starts = self._reserve(req)
            if starts is None:
                break  # head-of-line blocking
            self.waiting.popleft()
            rows += self.copies
            seq = _Seq(req, starts, num_tokens=req.num_prompt_tokens)
            n = min(seq.num_tokens, budget)
            cost.add(0, n, n >= seq.num_tokens)
            seq.num_computed = n
            budget -= n
            self.running.append(seq)
            scheduled.append(seq)
        self._tick(cost, len(self.running))
        reserved = self.space.num_allocated
        self.reserved_steps += reserved
        self.peak_reserved = max(self.peak_reserved, reserved)
        finished = []
        for seq in scheduled:
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk short of the prompt's end samples nothing
            seq.num_tokens += 1
            seq.num_output += 1
            seq.rows = self.copies  # the prompt's sample starts every sample / beam
            if seq.num_output >= seq.req.num_output_tokens:
                for start in seq.starts:
                    self.space.free(start)
                tokens = [0] * seq.num_output
                out = tokens if self.copies == 1 else [tokens] * self.copies
                finished.append((seq.req.request_id, out))
        if finished:
            done = {rid for rid, _ in finished}
            self.running = [s for s in self.running if s.req.request_id not in done]
        return finished

    def _reserve(self, req: TraceRequest) -> list[int] | None:
        """One reservation per copy, all or none."""
        size = self.reservation(req)
        starts: list[int] = []
        for _ in range(self.copies):
            start = self.space.alloc(size)
            if start is None:
                for s in starts:
                    self.space.free(s)
                return None
            starts.append(start)
        return starts

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def extra(self) -> dict[str, Any]:
        return {
            **super().extra(),
            "mean_reserved_tokens": self.reserved_steps / max(1, self.num_steps),
            "peak_reserved_tokens": self.peak_reserved,
        }


class StaticBatchSim(_SimServer):
    """FasterTransformer-style serving: request-level static batches, no iteration-level
    scheduling.

    When the GPU is idle, the earliest waiting requests (up to batch_size, the number of
    max-length reservations the budget holds) form a batch: one prefill step over the
    prompts padded to the longest, then decode steps for every row until the longest
    output ends (a finished row keeps its slot and is computed as padding); all of the
    batch's requests return together when it ends.
    """

    def __init__(
        self,
        model: StepTimeModel,
        clock: VirtualClock,
        *,
        budget_tokens: int,
        max_model_len: int = MAX_MODEL_LEN,
        max_num_seqs: int = MAX_NUM_SEQS,
    ) -> None:
        super().__init__(model, clock)
        self.batch_size = static_batch_size(budget_tokens, max_model_len, max_num_seqs)
        self.waiting: collections.deque[TraceRequest] = collections.deque()
        self.batch: list[TraceRequest] = []
        self.prompt_len = self.steps_left = self.step_index = 0

    def add(self, req: TraceRequest) -> None:
        self.waiting.append(req)

    def step(self) -> list[tuple[str, list[int]]]:
        cost = StepCost()
        if not self.batch:
            take = min(self.batch_size, len(self.waiting))
            self.batch = [self.waiting.popleft() for _ in range(take)]
            self.prompt_len = max(r.num_prompt_tokens for r in self.batch)
            self.steps_left = max(r.num_output_tokens for r in self.batch)
            cost.add(0, self.prompt_len, True, rows=len(self.batch))  # the padded prefill
            self.step_index = 0
        else:
            cost.add(self.prompt_len + self.step_index - 1, 1, True, rows=len(self.batch))
        self.step_index += 1
        self.steps_left -= 1
        self._tick(cost, len(self.batch))
        if self.steps_left:
            return []
        finished = [(r.request_id, [0] * r.num_output_tokens) for r in self.batch]
        self.batch = []
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.batch)

    @property
    def num_running(self) -> int:
        return len(self.batch)


SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "fastertransformer")


def make_system(
    name: str,
    model: StepTimeModel,
    clock: VirtualClock,
    *,
    budget_tokens: int,
    mode: str = "basic",
    width: int = 1,
    max_num_seqs: int = MAX_NUM_SEQS,
) -> _SimServer:
    """One of SYSTEMS on the given clock and KV budget, serving each request as basic
    sampling (width 1), parallel sampling of n = width samples or a beam search of
    `width` beams (FORK_MODES; FasterTransformer only basic); max_num_seqs caps the
    sequences (samples / beams) a step runs, paged and Orca alike."""
    if mode not in FORK_MODES:
        raise ValueError(f"mode={mode!r} must be one of {FORK_MODES}")
    if mode == "basic" and width != 1:
        raise ValueError(f"width={width!r} must be 1 for basic sampling")
    if name == "paged":
        if mode == "basic":
            return PagedSim(model, clock, budget_tokens=budget_tokens, max_num_seqs=max_num_seqs)
        return PagedForkSim(model, clock, mode, width, budget_tokens=budget_tokens,
                            max_num_seqs=max_num_seqs)  # fmt: skip
    if name.startswith("orca-") and name[5:] in POLICIES:
        return OrcaSim(model, clock, name[5:], budget_tokens=budget_tokens, copies=width,
                       max_num_seqs=max_num_seqs)  # fmt: skip
    if name == "fastertransformer":
        if mode != "basic":
            raise ValueError(f"fastertransformer serves basic sampling only, not mode={mode!r}")
        return StaticBatchSim(model, clock, budget_tokens=budget_tokens, max_num_seqs=max_num_seqs)
    raise ValueError(f"name={name!r} must be one of {SYSTEMS}")


# ------------------------------------------------------------------ traces and runs
@dataclasses.dataclass(frozen=True)
class SimTrace:
    """One dataset's requests in arrival order and a unit-rate Poisson process.

    The trace at rate r is the same requests with arrival times divided by r, cut at
    duration_s: a higher rate compresses the same trace, so the latency curve over r
    has no noise from a fresh draw per rate (what makes bisection on it well posed).
    """

    dataset: str
    requests: tuple[TraceRequest, ...]
    unit_arrivals: np.ndarray  # f64[len(requests)], seconds at 1 request/s
    seed: int

    def max_rate(self, duration_s: float) -> float:
        """The highest rate whose duration_s of arrivals the trace still holds."""
        return float(self.unit_arrivals[-1]) / duration_s

    def at_rate(self, rate: float, duration_s: float) -> tuple[list[TraceRequest], np.ndarray]:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate={rate!r} must be a finite number > 0 (requests per second)")
        arrivals = self.unit_arrivals / rate
        n = int(np.searchsorted(arrivals, duration_s, side="left"))
        if n >= len(self.requests):
            raise ValueError(
                f"rate={rate!r} x duration_s={duration_s!r} needs more than the "
                f"{len(self.requests)} requests the trace holds"
            )
        return list(self.requests[: max(n, 1)]), arrivals[: max(n, 1)]


_TOKEN_POOL = 1 << 16


def make_trace(dataset: str, num_requests: int, *, seed: int = 0) -> SimTrace:
    """num_requests requests with `dataset`'s full-size length distributions (the paper's
    means, see workloads.py) and their unit-rate arrivals; deterministic in seed."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r} must be one of {sorted(DATASETS)}")
    rng = np.random.default_rng(seed)
    inp, out = DATASETS[dataset]
    prompt_lens = inp.sample(rng, num_requests)
    output_lens = out.sample(rng, num_requests)
    # Prompts are random windows of one random pool: prefix caching is off, so their
    # content never matters, and shared int objects keep a 100k-request trace small.
    pool = rng.integers(3, VOCAB_SIZE, size=_TOKEN_POOL).tolist()
    starts = rng.integers(0, _TOKEN_POOL - max(prompt_lens), size=num_requests).tolist()
    reqs = [
        TraceRequest(f"{dataset}-{i}", tuple(pool[a : a + p]), o)
        for i, (a, p, o) in enumerate(zip(starts, prompt_lens, output_lens))
    ]
    arrivals = poisson_arrivals(num_requests, 1.0, seed + 1)
    return SimTrace(dataset, tuple(reqs), arrivals, seed)


def simulate(
    system: str,
    trace: list[TraceRequest],
    arrivals: np.ndarray,
    model: StepTimeModel,
    *,
    budget_tokens: int,
    mode: str = "basic",
    width: int = 1,
    max_num_seqs: int = MAX_NUM_SEQS,
) -> dict[str, Any]:
    """Serves the trace online on a fresh virtual clock; latency metrics + the system's tally.

    Normalized latency (run_metrics) = (finish - arrival) / output tokens per request,
    mean over requests; a forked request finishes when its last sample / beam does and
    its output length is one sequence's (the paper's definition, per-request latency
    over output length).
    """
    clock = VirtualClock()
    server = make_system(system, model, clock, budget_tokens=budget_tokens, mode=mode, width=width,
                         max_num_seqs=max_num_seqs)  # fmt: skip
    run = serve_online(server, trace, arrivals, clock=clock, sleep=clock.sleep)
    assert len(run.records) == len(trace), "a request never finished: the driver lost it"
    return {**run_metrics(run), **server.extra(), "system": system}


def unloaded_latency(
    system: str,
    trace: list[TraceRequest],
    model: StepTimeModel,
    *,
    budget_tokens: int,
    mode: str = "basic",
    width: int = 1,
    max_num_seqs: int = MAX_NUM_SEQS,
) -> float:
    """Mean normalized latency with each request served alone (rate -> 0)."""
    clock = VirtualClock()
    server = make_system(system, model, clock, budget_tokens=budget_tokens, mode=mode, width=width,
                         max_num_seqs=max_num_seqs)  # fmt: skip
    run = serve_unloaded(server, trace, clock=clock)
    return run_metrics(run)["mean_normalized_latency_s"]
