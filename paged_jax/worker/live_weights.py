"""Live weights: read and replace a runner's weights, and hand its device memory back (sleep).

One canonical structure on every platform: the model's own ``nnx.state`` (every layer's
parameters as the dense forward ``nnx.merge(graphdef, weights)(input_ids)`` takes them).
The step programs take the served weights as jit arguments, so new values of the same
shapes, dtypes and shardings never recompile. What the runner serves:

    unscanned     the canonical State itself          get: no copy    update: no copy
    scanned       (rest, StackedLayers): layer i =    get: one copy   update: one copy
    (scan_layers)  stacked[i % p][i // p], tail        (unstacked)     (restacked on device)

A scanned engine's unstack and restack programs (ScanPrograms) are compiled from shapes
at the LLM's warm-up, so no call here compiles after it.

Sleep level 1 deletes the KV caches and moves the weights to host memory; level 2 deletes
the weights outright (update_weights / load_weights supply new ones before wake_up). wake_up
puts the weights back (if on the host) and rebuilds zeroed KV caches by the calls that
built them, so neither compiles. The caller (LLM) refuses while requests are unfinished
and resets the prefix cache: no block computed under other weights is ever served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.worker.runner import Runner, compiles_counted_by

Path = tuple[Any, ...]


def path_name(path: Path) -> str:
    """'layers.0.attn.q_proj.kernel' of a param path."""
    return ".".join(map(str, path))


def _key_part(key: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def flat_weights(tree: Any) -> dict[Path, Any]:
    """{param path: array} of an nnx.State or a nested dict / list of arrays (a pure dict).

    The ``.value`` of an nnx Variable is not part of the path, so a State and its
    ``nnx.to_pure_dict`` give the same paths.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    flat = {}
    for keys, leaf in leaves:
        path = tuple(_key_part(k) for k in keys)
        if path and path[-1] == "value" and type(keys[-1]).__name__ == "GetAttrKey":
            path = path[:-1]
        flat[path] = leaf
    return flat


def _unstack_fn(stacked: tuple[Any, ...]) -> list[list[Any]]:
    """Per scan step s and period position j, layer s * p + j's state (slices of the stack)."""
    num_steps = jax.tree.leaves(stacked)[0].shape[0]
    return [[jax.tree.map(lambda x, s=s: x[s], st) for st in stacked] for s in range(num_steps)]


def _abstract_unstack(stacked: tuple[Any, ...]) -> list[list[Any]]:
    """_unstack_fn's result as ShapeDtypeStructs with the slices' shardings (nothing runs)."""

    def row(x: jax.Array) -> jax.ShapeDtypeStruct:
        sharding = x.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):  # the stack's axis is whole
            spec = jax.sharding.PartitionSpec(*sharding.spec[1:])
            sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)

    num_steps = jax.tree.leaves(stacked)[0].shape[0]
    return [[jax.tree.map(row, st) for st in stacked] for _ in range(num_steps)]


def _restack_fn(layers: list[list[Any]]) -> tuple[Any, ...]:
    """The inverse of _unstack_fn: per period position, every step's state stacked."""
    period = len(layers[0])
    return tuple(
        jax.tree.map(lambda *xs: jnp.stack(xs), *[step[j] for step in layers])
        for j in range(period)
    )


def _lowering_arg(x: Any) -> jax.ShapeDtypeStruct:
    """x's shape and dtype, and its sharding when a mesh's; a single device's arrays stay
    uncommitted (as the stack the runner built), so every step keys the same program."""
    sharding = x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


class ScanPrograms:
    """The compiled unstack (_unstack_fn) and restack (_restack_fn) of one served stack.

    Lowered from shapes and shardings (``stacked`` may be abstract: the stand-ins of a
    sleeping runner), so building them runs nothing. The restack keeps the served stack's
    shardings (a mesh's); on a single device its output is left uncommitted.
    """

    def __init__(self, stacked: tuple[Any, ...]):
        abstract = jax.tree.map(_lowering_arg, stacked)
        self.unstack = jax.jit(_unstack_fn).lower(abstract).compile()
        shardings = jax.tree.map(lambda x: x.sharding, stacked)
        named = any(isinstance(x, jax.sharding.NamedSharding) for x in jax.tree.leaves(shardings))
        restack = jax.jit(_restack_fn, **(dict(out_shardings=shardings) if named else {}))
        steps = jax.tree.map(_lowering_arg, _abstract_unstack(stacked))
        self.restack = restack.lower(steps).compile()


@dataclasses.dataclass
class Asleep:
    """What sleep left: the level, per canonical path its host copy (None: dropped), and
    whether update_weights / load_weights have put new weights on the device since."""

    level: int
    host: dict[Path, np.ndarray | None]
    weights_on_device: bool = False


class LiveWeights:
    """The canonical view of one runner's weights, and its sleep state.

    Args:
        runner: the engine's Runner, of an NNX model (``runner.canonical_treedef``).
        owns_weights: sleep deletes the served arrays (the engine's own: a model it
            loaded). False only drops the engine's references, so a caller's model that
            shares them stays usable (and its arrays stay on the device).
    """

    def __init__(self, runner: Runner, *, owns_weights: bool = True):
        if runner.canonical_treedef is None or runner.weights is None:
            raise ValueError(
                "the model is not an nnx.Module: its weights are constants of the step "
                "programs and cannot be read or replaced"
            )
        self.runner = runner
        self.owns_weights = owns_weights
        self.asleep: Asleep | None = None
        # A scanned engine's unstack and restack programs, compiled by warmup() or on
        # first use (ScanPrograms).
        self._programs: ScanPrograms | None = None
        treedef = runner.canonical_treedef
        # The canonical paths in order, and each one's shape, dtype and sharding.
        self.paths: list[Path] = list(
            flat_weights(jax.tree.unflatten(treedef, [0] * treedef.num_leaves))
        )
        served = self._canonical_leaves(runner.weights, _abstract_unstack)  # no copy
        self.specs: dict[Path, jax.ShapeDtypeStruct] = {
            p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            for p, x in zip(self.paths, served)
        }
        self._spec_list = [self.specs[p] for p in self.paths]
        self._shapes_dtypes = [(s.shape, s.dtype) for s in self._spec_list]
        # Per canonical leaf, whether a host array goes to its sharding (a mesh's) or,
        # uncommitted, to the default device as the runner's own single-device arrays.
        self._to_sharding = [
            isinstance(s.sharding, jax.sharding.NamedSharding) for s in self._spec_list
        ]
        # Tree structures update() has accepted -> where each canonical path's leaf sits
        # among the tree's leaves: a repeated update checks shapes and dtypes only.
        self._leaf_order: dict[Any, list[int]] = {}
        self._served_treedef = jax.tree.structure(runner.weights)

    @property
    def scanned(self) -> bool:
        return self.runner.layer_scan is not None

    def warmup(self) -> None:
        """Compiles a scanned engine's unstack and restack programs from the served stack's
        shapes and shardings (nothing runs, nothing is copied), so that get / update /
        load / wake_up compile nothing later. Unscanned: nothing to compile."""
        if self.scanned and self._programs is None:
            with compiles_counted_by(self.runner):
                self._programs = ScanPrograms(self.runner.weights[1].stacked)

    def _unstack(self, stacked: tuple[Any, ...]) -> list[list[Any]]:
        self.warmup()
        return self._programs.unstack(stacked)

    def _restack(self, steps: list[list[Any]]) -> tuple[Any, ...]:
        self.warmup()
        return self._programs.restack(steps)

    # ------------------------------------------------------------------ reading
    def _canonical_leaves(self, weights: Any, unstack: Any) -> list[Any]:
        """Served weights (device or host copies) as canonical leaves; ``unstack`` cuts a
        scanned stack into per-step states (_unstack_fn, jitted or not)."""
        if not self.scanned:
            return jax.tree.leaves(weights)
        rest, layers = weights
        by_path = dict(flat_weights(rest))
        plan = self.runner.layer_scan.plan
        steps = unstack(layers.stacked)
        states = [steps[i // plan.period][i % plan.period] for i in range(plan.num_scanned)]
        states += list(layers.tail)
        for i, state in enumerate(states):
            for sub, x in flat_weights(state).items():
                by_path[("layers", i, *sub)] = x
        return [by_path[p] for p in self.paths]

    def get(self) -> Any:
        """The served weights as the model's nnx.State (the served arrays themselves when
        unscanned; one unstacked copy when scanned)."""
        self._check_awake("get_weights")
        with compiles_counted_by(self.runner):
            leaves = self._canonical_leaves(self.runner.weights, self._unstack)
        return jax.tree.unflatten(self.runner.canonical_treedef, leaves)

    # ------------------------------------------------------------------ writing
    def check(self, weights: Any) -> list[Any]:
        """The leaves of ``weights`` in canonical order; ValueError on the first difference.

        The paths of a tree structure are compared once; a tree of a structure seen
        before (the State get_weights returned, its pure dict) costs one flatten and a
        shape / dtype comparison per leaf.
        """
        leaves, treedef = jax.tree.flatten(weights)
        order = self._leaf_order.get(treedef)
        if order is None:
            order = self._check_paths(weights)
            self._leaf_order[treedef] = order
        canonical = [leaves[i] for i in order]
        try:  # one comparison of every (shape, dtype) at once; the loop below names a difference
            if [(x.shape, x.dtype) for x in canonical] == self._shapes_dtypes:
                return canonical
        except AttributeError:  # a leaf that is not an array
            pass
        for p, x, spec in zip(self.paths, canonical, self._spec_list):
            shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
            if shape is None or dtype is None:  # a list, a scalar: what numpy makes of it
                shape, dtype = np.shape(x), np.asarray(x).dtype
            if tuple(shape) != spec.shape or dtype != spec.dtype:
                raise ValueError(
                    f"weights[{path_name(p)!r}] has shape {tuple(shape)} and dtype "
                    f"{jnp.dtype(dtype)}; the served parameter has shape {spec.shape} and "
                    f"dtype {spec.dtype}"
                )
        return canonical

    def _check_paths(self, weights: Any) -> list[int]:
        """Per canonical path, the index of its leaf in ``weights``; ValueError naming the
        first path missing or not served."""
        given = list(flat_weights(weights))
        position = {q: i for i, q in enumerate(given)}
        for p in self.paths:
            if p not in position:
                extra = [path_name(q) for q in given if q not in self.specs][:3]
                raise ValueError(
                    f"weights[{path_name(p)!r}] is missing: weights must have the structure "
                    f"get_weights() returns (paths it does not have: {extra})"
                )
        for q in given:
            if q not in self.specs:
                raise ValueError(
                    f"weights[{path_name(q)!r}] is not a parameter of the served model: "
                    "weights must have the structure get_weights() returns"
                )
        return [position[p] for p in self.paths]

    def update(self, weights: Any) -> None:
        """Serves ``weights``, a tree of get_weights' structure (ValueError otherwise)."""
        self._update_leaves(self.check(weights))

    def _placed_all(self, leaves: list[Any]) -> list[jax.Array]:
        """Canonical leaves on the served parameters' devices: an array already there with
        the served sharding as is; the others in (at most) two batched transfers, host
        arrays of a single device uncommitted, the rest to their sharding."""
        out = list(leaves)
        to_default: list[int] = []
        to_sharding: list[int] = []
        for i, (x, spec) in enumerate(zip(leaves, self._spec_list)):
            if isinstance(x, jax.Array):
                if x.sharding != spec.sharding:
                    to_sharding.append(i)
            elif self._to_sharding[i]:
                to_sharding.append(i)
            else:
                to_default.append(i)
        if to_default:
            placed = jax.device_put([np.asarray(leaves[i]) for i in to_default])
            for i, x in zip(to_default, placed):
                out[i] = x
        if to_sharding:
            shardings = [self._spec_list[i].sharding for i in to_sharding]
            placed = jax.device_put([leaves[i] for i in to_sharding], shardings)
            for i, x in zip(to_sharding, placed):
                out[i] = x
        return out

    def _update_leaves(self, leaves: list[Any]) -> None:
        with compiles_counted_by(self.runner):
            self._serve(self._placed_all(leaves))
        if self.asleep is not None:  # the new weights are on the device now
            self.asleep.host, self.asleep.weights_on_device = {}, True

    def update_some(self, values: Mapping[Path, np.ndarray]) -> None:
        """Replaces the params in ``values`` (host arrays of the served shapes), keeping the rest."""
        unknown = [p for p in values if p not in self.specs]
        assert not unknown, f"the loader produced paths the model lacks (a bug): {unknown}"
        asleep = self.asleep
        if asleep is not None and not asleep.weights_on_device:
            if asleep.level == 1:  # onto the host copy; wake_up moves it to the device
                asleep.host.update({p: np.asarray(v) for p, v in values.items()})
                return
            missing = [path_name(p) for p in self.paths if p not in values]
            if missing:
                raise ValueError(
                    f"after sleep(level=2) the weights must be supplied whole: "
                    f"{len(missing)} parameter(s) missing, first {missing[0]!r}"
                )
            self._update_leaves([values[p] for p in self.paths])
            return
        with compiles_counted_by(self.runner):
            current = self._canonical_leaves(self.runner.weights, self._unstack)
            leaves = [values.get(p, x) for p, x in zip(self.paths, current)]
            self._serve(self._placed_all(leaves))

    def _serve(self, leaves: list[jax.Array]) -> None:
        """Sets the runner's weights from canonical leaves (restacked on device when scanned)."""
        runner = self.runner
        if not self.scanned:
            runner.weights = jax.tree.unflatten(self._served_treedef, leaves)
            return
        rest, layers = runner.weights
        by_path = dict(zip(self.paths, leaves))

        def state_like(like: Any, prefix: Path) -> Any:
            subs = flat_weights(like)
            return jax.tree.unflatten(
                jax.tree.structure(like), [by_path[(*prefix, *s)] for s in subs]
            )

        plan = layers.plan
        p, n = plan.period, plan.num_steps
        steps = [
            [state_like(layers.stacked[j], ("layers", s * p + j)) for j in range(p)]
            for s in range(n)
        ]
        stacked = self._restack(steps)
        tail = tuple(
            state_like(state, ("layers", plan.num_scanned + t))
            for t, state in enumerate(layers.tail)
        )
        runner.weights = (
            state_like(rest, ()),
            dataclasses.replace(layers, stacked=stacked, tail=tail),
        )

    # ------------------------------------------------------------------ sleep
    def sleep(self, level: int) -> None:
        """Deletes the KV caches; level 1 moves the weights to host memory, level 2 drops them."""
        runner = self.runner
        if level == 1:  # host copies of the served arrays, cut into layers on the host
            host_served = jax.device_get(runner.weights)
            leaves = self._canonical_leaves(host_served, _unstack_fn)
            host: dict[Path, np.ndarray | None] = dict(zip(self.paths, leaves))
        else:
            host = dict.fromkeys(self.paths)
        # The runner keeps abstract stand-ins (the structure _serve rebuilds from).
        served, kv = runner.weights, runner.kv_caches
        runner.weights = jax.tree.map(_abstract, served)
        runner.kv_caches = jax.tree.map(_abstract, kv)
        owned = [*jax.tree.leaves(served)] if self.owns_weights else []
        for x in [*owned, *jax.tree.leaves(kv)]:
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        del served, kv, owned
        self.asleep = Asleep(level, host)

    def wake_up(self) -> None:
        """Weights back on the device (unless update_weights put new ones there) and zeroed
        KV caches; RuntimeError after sleep(level=2) without new weights."""
        asleep = self.asleep
        if asleep is None:
            return
        if not asleep.weights_on_device:
            missing = [path_name(p) for p, v in asleep.host.items() if v is None]
            if missing:
                raise RuntimeError(
                    f"wake_up after sleep(level={asleep.level}) needs the weights: call "
                    f"update_weights or load_weights first ({len(missing)} parameter(s) "
                    f"missing, first {missing[0]!r})"
                )
        runner = self.runner
        with compiles_counted_by(runner):
            if not asleep.weights_on_device:
                self._serve(self._placed_all([asleep.host[p] for p in self.paths]))
            runner.kv_caches = runner.make_kv_caches()
        self.asleep = None

    def _check_awake(self, what: str) -> None:
        if self.asleep is not None:
            raise RuntimeError(f"{what} while the engine sleeps: call wake_up() first")


def _abstract(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def live_bytes() -> int:
    """Bytes of every live jax array in the process, on every device (jax.live_arrays)."""
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


__all__ = ["LiveWeights", "flat_weights", "live_bytes", "path_name"]
