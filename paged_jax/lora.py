"""Multi-LoRA, host side: LoRARequest, PEFT adapters read as numpy, the registry, the slot table.

Never imports jax. An adapter is read once from its PEFT directory (adapter_config.json +
adapter_model.safetensors), checked against the model's projections and kept on the host
with its rank padded to ``max_lora_rank`` and its scaling folded into B. ``max_loras`` of
them sit in device slots at once (paged_jax.models.lora holds the stacks); AdapterSlots
decides which, least recently used first, never evicting one a running request uses.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import pathlib
import re
import struct
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

# The projections an adapter may target, as PEFT names them in a Llama-style layer.
ATTENTION_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LORA_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_LORA_MODULES + MLP_LORA_MODULES

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT's key of one LoRA factor: ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """One adapter to serve a request with (vLLM's LoRARequest).

    Attributes:
        lora_name: a name for the adapter (errors and the CLI's JSONL "lora" key use it).
        lora_int_id: the adapter's id, an int >= 1, unique per adapter: it keys the
            registry and enters the request's block hashes (prefix caching per adapter).
        lora_path: the PEFT adapter directory (adapter_config.json,
            adapter_model.safetensors).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r} must be a non-empty str")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be an int >= 1")
        if not isinstance(self.lora_path, str | os.PathLike):
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r} must be a path")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """An adapter as the device stacks take it.

    Attributes:
        request: the LoRARequest it was read for.
        rank: the adapter's own r (<= max_lora_rank).
        scaling: lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), folded into B.
        target_modules: the projections it changes, in LORA_MODULES order.
        weights: module -> (A f32[num_layers, in, R], B f32[num_layers, R, out]), R =
            max_lora_rank (zero past r; zero on layers the adapter leaves alone), B
            already multiplied by the scaling: a token's delta is ``(x @ A) @ B``.
    """

    request: LoRARequest
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _fail(request: LoRARequest, field: str, value: object, expected: str) -> ValueError:
    return ValueError(
        f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {field}={value!r} "
        f"must be {expected}"
    )


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as numpy (F32, F16, BF16 via ml_dtypes), no torch.

    The format: an 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the raw bytes.
    """
    import ml_dtypes

    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    body = memoryview(data)[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {info['dtype']!r}; expected one of "
                f"{sorted(dtypes)}"
            )
        start, stop = info["data_offsets"]
        array = np.frombuffer(body[start:stop], dtype=dtypes[info["dtype"]])
        out[name] = array.reshape(info["shape"]).astype(np.float32)
    return out


def read_peft_adapter(
    request: LoRARequest,
    *,
    module_shapes: Mapping[str, tuple[int, int]],
    num_layers: int,
    max_lora_rank: int,
    refused: Mapping[str, str] | None = None,
    repeated_heads: Mapping[str, tuple[int, Mapping[int, int]]] | None = None,
) -> LoRAAdapter:
    """Reads and checks a PEFT LoRA adapter directory for a model.

    Args:
        request: which adapter.
        module_shapes: the model's LoRA-capable projections, module -> (in, out).
        num_layers: the model's depth.
        max_lora_rank: the engine's largest rank.
        refused: module -> why the model cannot take LoRA there (MoE experts).
        repeated_heads: module -> (head_dim, {checkpoint out dim: repeats}) for k/v
            projections whose KV heads the served model repeats (tensor parallelism over
            more devices than KV heads): an adapter's B written for the checkpoint's
            heads gets each head's rows repeated like the kernel's.

    Raises:
        ValueError: naming the adapter and the field: a missing file, a rank above
            max_lora_rank, a module the family lacks, a tensor whose shape does not fit,
            a PEFT feature this engine does not serve (DoRA, biases, modules_to_save).
    """
    root = pathlib.Path(request.lora_path)
    config_file, weights_file = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    for file in (config_file, weights_file):
        if not file.is_file():
            raise _fail(
                request, "lora_path", str(root), f"a PEFT adapter directory with {file.name}"
            )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise _fail(request, ADAPTER_CONFIG, str(err), "readable JSON") from err
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(request, "peft_type", config.get("peft_type"), "'LORA'")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(request, "r", rank, "an int >= 1")
    if rank > max_lora_rank:
        raise _fail(request, "r", rank, f"<= max_lora_rank={max_lora_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise _fail(request, "lora_alpha", alpha, "a number")
    for field, ok, expected in (
        ("use_dora", not config.get("use_dora"), "false (DoRA is not served)"),
        ("bias", config.get("bias", "none") == "none", "'none'"),
        ("modules_to_save", not config.get("modules_to_save"), "empty"),
        ("fan_in_fan_out", not config.get("fan_in_fan_out"), "false"),
        ("rank_pattern", not config.get("rank_pattern"), "empty (one r for every module)"),
        ("alpha_pattern", not config.get("alpha_pattern"), "empty"),
    ):
        if not ok:
            raise _fail(request, field, config.get(field), expected)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = read_safetensors(weights_file)
    factors: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    refused = refused or {}
    for key, array in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise _fail(request, "tensor", key, "a LoRA factor of a decoder layer's projection")
        layer, module, which = int(match[1]), match[2], match[3]
        if module in refused:
            raise _fail(request, "target_modules", module, refused[module])
        if module not in module_shapes:
            raise _fail(request, "target_modules", module, f"one of {sorted(module_shapes)}")
        if not 0 <= layer < num_layers:
            raise _fail(request, "tensor", key, f"in a layer < num_hidden_layers={num_layers}")
        factors.setdefault((module, layer), {})[which] = array
    if not factors:
        raise _fail(request, ADAPTER_WEIGHTS, "no LoRA factors", "an adapter's weights")
    weights = {}
    for (module, layer), pair in sorted(factors.items()):
        d_in, d_out = module_shapes[module]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            missing = "lora_A" if a is None else "lora_B"
            raise _fail(request, f"layers.{layer}.{module}", missing, "present (A and B pair)")
        head_dim, repeats = (repeated_heads or {}).get(module, (0, {}))
        if b.ndim == 2 and b.shape[0] in repeats:  # f[kv * head_dim, r] -> each head r times
            heads = b.shape[0] // head_dim
            b = np.repeat(b.reshape(heads, head_dim, -1), repeats[b.shape[0]], axis=0)
            b = b.reshape(-1, b.shape[-1])
        for name, array, want in (("lora_A", a, (rank, d_in)), ("lora_B", b, (d_out, rank))):
            if array.shape != want:
                raise _fail(
                    request, f"layers.{layer}.{module}.{name}.shape", array.shape, f"{want}"
                )
        if module not in weights:
            weights[module] = (
                np.zeros((num_layers, d_in, max_lora_rank), np.float32),
                np.zeros((num_layers, max_lora_rank, d_out), np.float32),
            )
        stack_a, stack_b = weights[module]
        stack_a[layer, :, :rank] = a.T  # torch weight f[r, in] -> x @ A
        stack_b[layer, :rank, :] = b.T * scaling  # f[out, r] -> @ B, scaled once here
    ordered = tuple(m for m in LORA_MODULES if m in weights)
    return LoRAAdapter(request, rank, float(scaling), ordered, weights)


class LoRARegistry:
    """Adapters read so far, by lora_int_id (kept on the host; read once).

    Args:
        module_shapes, num_layers, max_lora_rank, refused: as read_peft_adapter.
    """

    def __init__(
        self,
        module_shapes: Mapping[str, tuple[int, int]],
        num_layers: int,
        max_lora_rank: int,
        refused: Mapping[str, str] | None = None,
        repeated_heads: Mapping[str, tuple[int, Mapping[int, int]]] | None = None,
    ):
        self.module_shapes = dict(module_shapes)
        self.num_layers = num_layers
        self.max_lora_rank = max_lora_rank
        self.refused = dict(refused or {})
        self.repeated_heads = dict(repeated_heads or {})
        self.adapters: dict[int, LoRAAdapter] = {}

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of ``request``, read on first use; ValueError on a bad adapter or
        an id already taken by another name or path."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request={request!r} must be a paged_jax.LoRARequest or None")
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if known.request != request:
                raise ValueError(
                    f"lora_request={request!r}: lora_int_id={request.lora_int_id} is already "
                    f"{known.request!r}; one id per adapter"
                )
            return known
        adapter = read_peft_adapter(
            request,
            module_shapes=self.module_shapes,
            num_layers=self.num_layers,
            max_lora_rank=self.max_lora_rank,
            refused=self.refused,
            repeated_heads=self.repeated_heads,
        )
        self.adapters[request.lora_int_id] = adapter
        return adapter


class AdapterSlots:
    """Which adapter sits in which of the ``max_loras`` device slots, LRU first out.

        slots   [ 7 | 3 | - ]      adapters 7 and 3 resident, slot 2 free
        assign({3, 9}, pinned={3, 9})
                -> load 9 into slot 2           a free slot first
        assign({5}, pinned={5, 9})
                -> load 5 into slot 0           7 is the least recently used unpinned

    Pinned adapters (those of running requests) are never evicted; the scheduler admits
    a request only when its adapter is resident or a slot can be freed for it
    (``fits``), so ``assign`` always finds room.
    """

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.num_loads = 0  # adapters written into a slot so far

    def assign(self, adapter_ids: Iterable[int], pinned: Iterable[int]) -> list[tuple[int, int]]:
        """Makes every adapter of ``adapter_ids`` resident; returns the (slot, adapter id)
        loads this needs (the caller writes their weights before the step runs)."""
        wanted = list(dict.fromkeys(adapter_ids))
        keep = set(pinned) | set(wanted)
        loads = []
        for adapter_id in wanted:
            if adapter_id in self.slot_of:
                self.slot_of.move_to_end(adapter_id)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((a for a in self.slot_of if a not in keep), None)
                assert victim is not None, (
                    f"no LoRA slot for adapter {adapter_id}: every slot is pinned; the "
                    "scheduler admitted more adapters than max_loras"
                )
                slot = self.slot_of.pop(victim)
            self.slot_of[adapter_id] = slot
            loads.append((slot, adapter_id))
            self.num_loads += 1
        return loads

    def clear(self) -> None:
        """Forgets every resident adapter (their slots are reloaded on next use)."""
        self.slot_of.clear()

    @staticmethod
    def fits(adapter_id: int, running_adapter_ids: Iterable[int], max_loras: int) -> bool:
        """Whether a request of ``adapter_id`` may join running requests of these adapters:
        the distinct adapters in use then still fit the slots."""
        in_use = set(running_adapter_ids)
        return adapter_id in in_use or len(in_use) < max_loras


class LoRAAdapters:
    """The engine's LoRA component: a request's adapter resolved on arrival, each step's
    adapters made resident and its token rows given their slots.

    Args:
        registry: the LoRARegistry adapters are read through.
        max_loras: device slots.
        write_slot: callable(slot, weights) writing an adapter's stacks into a device
            slot (models.lora.DeviceLoRA.write_slot).
    """

    def __init__(self, registry: LoRARegistry, max_loras: int, write_slot):
        self.registry = registry
        self.slots = AdapterSlots(max_loras)
        self._write_slot = write_slot

    def adapter_id(self, request: LoRARequest | None) -> int | None:
        """The id a request of ``request`` carries (its block hashes' adapter key);
        reads the adapter on first use. ValueError on a bad adapter."""
        if request is None:
            return None
        return self.registry.resolve(request).request.lora_int_id

    def step_slots(self, step, requests, running):
        """``step`` (a StepInput) with ``lora_slots`` set: each token row's adapter slot.

        Args:
            step: the packed step; its sequences are ``requests`` in order.
            requests: the scheduled Request of each sequence.
            running: every running Request (their adapters stay pinned in their slots).

        Adapters not resident are written into slots first (LRU, unpinned ones evicted).
        A step with no adapter row is returned as it is (the runner feeds -1 rows).
        """
        ids = [r.adapter_id for r in requests]
        if all(i is None for i in ids):
            return step
        pinned = {r.adapter_id for r in running if r.adapter_id is not None}
        for slot, adapter_id in self.slots.assign([i for i in ids if i is not None], pinned):
            self._write_slot(slot, self.registry.adapters[adapter_id].weights)
        slot_of = self.slots.slot_of
        seq_slots = np.array([-1 if i is None else slot_of[i] for i in ids], np.int32)
        qsl = np.asarray(step.attention.query_start_loc)[: len(ids) + 1]
        token_slots = np.full(step.bucket[0], -1, np.int32)
        token_slots[: int(qsl[-1])] = np.repeat(seq_slots, np.diff(qsl))
        return dataclasses.replace(step, lora_slots=token_slots)


def lora_requests_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt from generate's ``lora_request`` argument:
    one for every prompt, or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str | bytes):
        raise ValueError(
            f"lora_request={lora_request!r} must be a LoRARequest, None or a list of them"
        )
    if len(lora_request) != num_prompts:
        raise ValueError(
            f"len(lora_request)={len(lora_request)} must equal the number of prompts "
            f"({num_prompts})"
        )
    for i, r in enumerate(lora_request):
        if r is not None and not isinstance(r, LoRARequest):
            raise ValueError(f"lora_request[{i}]={r!r} must be a LoRARequest or None")
    return list(lora_request)
