"""Judging a replayed gradient sequence: the first step and quantity where the two optimizers
part, within float32 rounding, and what it is.

Quantities are checked step by step in the order a step computes them: skipped or applied
(loss scaling), the step count, the optimizer state (``mu``, ``nu``, ``nu_max``, ``trace``:
Adam's moments, AMSGrad's maximum, the momentum buffer), then the update. Tolerances are float32
rounding, never chaos: an update within ``ULPS`` float32 eps of ``|p| + |update| + lr`` per
element, a state within ``ULPS`` eps of the magnitudes it was computed from.

A difference is then named by the hypotheses a training-loop port gets wrong, each fitted to
the numbers and accepted only where it explains every differing element:

- state: coupled weight decay (the moment's increment differs by ``(1 - beta) w p``), the
  clipping factor (the increment differs by a constant factor: global, per parameter, by the loss
  scale when clipping runs before unscaling, or no clipping at all);
- update: the learning rate (the update is torch's direction at another rate; also one step
  ahead of or behind torch's schedule), weight decay applied to some parameters on one side only
  or at another strength, Adam's epsilon inside the square root, bias correction off, AMSGrad on
  one side only, Nesterov momentum on one side only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from parity.replay.jax_side import STATE_FIELDS, SideStep

if TYPE_CHECKING:  # torch's side (a golden check judges without torch: `parity.replay.record`)
    from parity.replay.layout import Layout

__all__ = ["ULPS", "Finding", "first_difference"]

ULPS = 8
EPS = float(np.finfo(np.float32).eps)
FIT = 4.0  # a hypothesis explains a difference when it leaves at most FIT tolerances of it
# XLA:CPU flushes subnormal float32 results to zero, torch keeps them: below the smallest normal
# number the two sides may differ by it (a squared 1e-20 gradient is 0 in JAX)
FLUSHED = 4 * float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class Finding:
    """The first difference of a replay.

    Attributes:
      scenario: the gradient sequence (``"real"``, ``"tiny"``, ``"extremes"``, ``"non-finite"``).
      step: the step within it.
      quantity: ``"skipped"``, ``"count"``, ``"mu"``, ``"nu"``, ``"nu_max"``, ``"trace"``,
        ``"clip factor"``, ``"weight decay"``, ``"lr"``, ``"eps placement"``,
        ``"bias correction"``, ``"amsgrad"``, ``"nesterov"`` or ``"update"``.
      paths: the Flax leaves it concerns (torch names in `torch_names`).
      torch_value, jax_value: the quantity on each side (a number or a short text).
      message: one sentence naming all of it.
      excess: the worst element's difference over its tolerance.
    """

    scenario: str
    step: int
    quantity: str
    paths: tuple[str, ...]
    torch_names: tuple[str, ...]
    torch_value: Any
    jax_value: Any
    message: str
    excess: float

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["paths"], out["torch_names"] = list(self.paths), list(self.torch_names)
        return out


def _clean(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), x, 0.0)


def _excess(a: np.ndarray, b: np.ndarray, tol: np.ndarray) -> float:
    """The largest ``|a - b| / tol`` (equal non-finite values count as equal)."""
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.where(same, 0.0, np.abs(a.astype(np.float64) - b))
        diff = np.where(np.isnan(diff), np.inf, diff)
        if diff.size == 0:
            return 0.0
        return float(np.max(diff / np.maximum(tol, np.finfo(np.float32).tiny)))


def _fit(y: np.ndarray, x: np.ndarray) -> float | None:
    """The least-squares factor ``c`` of ``y ~ c x`` (None where x is 0)."""
    xx = float(np.sum(np.square(x, dtype=np.float64)))
    return float(np.sum(x.astype(np.float64) * y)) / xx if xx > 0 else None


def _explains(observed, candidate, baseline, tol) -> bool:
    """Whether a hypothesis's `candidate` accounts for `observed`: within FIT tolerances of it,
    and at most a quarter of the difference the `baseline` (no such cause) leaves."""
    left = _excess(observed, candidate, tol)
    return left <= FIT and left <= 0.25 * _excess(observed, baseline, tol)


def _fmt(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


class _Judge:
    def __init__(
        self, scenario: str, torch_steps: list[SideStep], jax_steps: list[SideStep], layout: Layout
    ):
        self.scenario = scenario
        self.t, self.j = torch_steps, jax_steps
        self.layout = layout
        self.paths = sorted(torch_steps[0].update) if torch_steps else []

    def finding(self, k, quantity, paths, tv, jv, message, excess) -> Finding:
        names = []
        for path in paths:
            names += [n for n in self.layout.torch_names(path) if n not in names]
        return Finding(
            self.scenario, k, quantity, tuple(paths), tuple(names), tv, jv, message, excess
        )

    # -- tolerances --------------------------------------------------------------------------

    def update_tol(self, k: int, path: str) -> np.ndarray:
        t = self.t[k]
        lr = abs(float(t.lr.get(path, 0.0))) if isinstance(t.lr, dict) else 0.0
        # float32 hyperparameters: 1 - beta rounds to eps / (1 - beta) relative (optax keeps
        # beta in float32, torch in float64)
        betas = t.groups.get(path, {}).get("betas", ())
        rel = ULPS * EPS + sum(EPS / max(1.0 - b, EPS) for b in betas)
        return (
            ULPS * EPS * (np.abs(t.params[path]) + lr)
            + rel * np.abs(_clean(t.update[path]))
            + FLUSHED
        )

    def fit_tol(self, k: int, path: str) -> np.ndarray:
        """`update_tol` widened by the JAX update's own rounding: the bound a hypothesis's
        residual is held to (torch's update may be 0, e.g. at a warm-up's lr 0)."""
        betas = self.t[k].groups.get(path, {}).get("betas", ())
        rel = ULPS * EPS + sum(EPS / max(1.0 - b, EPS) for b in betas)
        return self.update_tol(k, path) + rel * np.abs(_clean(self.j[k].update[path]))

    def prev_state(self, k: int, quantity: str, path: str) -> np.ndarray:
        if k == 0 or quantity not in self.t[k - 1].state:
            return np.zeros_like(self.t[k].state[quantity][path])
        return self.t[k - 1].state[quantity][path]

    def state_tol(self, k: int, quantity: str, path: str) -> np.ndarray:
        t = self.t[k]
        g = np.abs(_clean(t.grads[path])) + np.abs(t.params[path])  # coupled decay adds w p
        term = g * g if quantity in ("nu", "nu_max") else g
        now = np.abs(_clean(t.state[quantity][path]))
        # the previous steps' differences (each within its own tolerance) carry into this one
        carried = 0.0
        if k > 0 and quantity in self.j[k - 1].state and path in self.j[k - 1].state[quantity]:
            carried = np.abs(
                _clean(self.j[k - 1].state[quantity][path])
                - _clean(self.prev_state(k, quantity, path))
            )
        prev = np.abs(_clean(self.prev_state(k, quantity, path)))
        return ULPS * EPS * (now + prev + term) + carried + FLUSHED

    # -- the walk ----------------------------------------------------------------------------

    def run(self) -> Finding | None:
        for k, (t, j) in enumerate(zip(self.t, self.j, strict=True)):
            if t.skipped != j.skipped:
                side = "torch" if t.skipped else "JAX"
                return self.finding(
                    k,
                    "skipped",
                    (),
                    t.skipped,
                    j.skipped,
                    f"step {k} ({self.scenario} gradients) skipped on the {side} side only "
                    f"(loss scale torch {_fmt(t.scale)}, JAX {_fmt(j.scale)})",
                    float("inf"),
                )
            if t.count is not None and j.count is not None and t.count != j.count:
                return self.finding(
                    k,
                    "count",
                    (),
                    t.count,
                    j.count,
                    f"step count after step {k} ({self.scenario} gradients): torch {t.count}, "
                    f"JAX {j.count}",
                    float("inf"),
                )
            for quantity in STATE_FIELDS:
                if quantity not in t.state or quantity not in j.state:
                    continue
                failing = self.failing_state(k, quantity)
                if failing:
                    return self.explain_state(k, quantity, failing)
            failing = {}
            for path in self.paths:
                e = _excess(j.update[path], t.update[path], self.update_tol(k, path))
                if e > 1:
                    failing[path] = e
            if failing:
                return self.explain_update(k, failing)
        return None

    def failing_state(self, k: int, quantity: str) -> dict[str, float]:
        t, j = self.t[k], self.j[k]
        failing = {}
        for path in self.paths:
            if path not in j.state[quantity] or path not in t.state[quantity]:
                continue
            e = _excess(
                j.state[quantity][path], t.state[quantity][path], self.state_tol(k, quantity, path)
            )
            if e > 1:
                failing[path] = e
        return failing

    # -- the state -----------------------------------------------------------------------------

    def _decay_and_weight(self, k: int, quantity: str, path: str) -> tuple[float, float]:
        group = self.t[k].groups.get(path, {})
        if quantity == "mu":
            beta = group.get("betas", (0.9, 0.999))[0]
            return beta, 1.0 - beta
        if quantity in ("nu", "nu_max"):
            beta = group.get("betas", (0.9, 0.999))[1]
            return beta, 1.0 - beta
        return float(group.get("momentum", 0.0)), 1.0 - float(group.get("dampening", 0.0))

    def explain_state(self, k: int, quantity: str, failing: dict[str, float]) -> Finding:
        t, j = self.t[k], self.j[k]
        worst = max(failing, key=failing.get)
        increments = {}
        for path in self.paths:
            if path not in j.state[quantity]:
                continue
            beta, _ = self._decay_and_weight(k, quantity, path)
            prev = self.prev_state(k, quantity, path).astype(np.float64)
            increments[path] = (
                t.state[quantity][path] - beta * prev,
                j.state[quantity][path] - beta * prev,
                self.state_tol(k, quantity, path),
            )
        # coupled weight decay: the increment differs by (1 - beta) w p
        if quantity in ("mu", "trace"):
            found = {}
            for path in failing:
                dt, dj, tol = increments[path]
                _, weight = self._decay_and_weight(k, quantity, path)
                x = weight * t.params[path].astype(np.float64)
                w = _fit(dj - dt, x)
                if w is None or not _explains(dj - dt, w * x, 0.0 * x, tol):
                    break
                found[path] = w
            else:
                ws = list(found.values())
                w = float(np.median(ws))
                decay = {p: float(t.groups[p].get("weight_decay", 0.0)) for p in found}
                if w > 0:
                    message = (
                        f"weight decay added to the gradient (coupled: {quantity} takes "
                        f"(1 - beta) x {w:.3g} x p) on the JAX side at step {k}, for "
                        f"{_list(found)}; torch's optimizer "
                        + (
                            "decays them decoupled (AdamW)"
                            if any(decay.values())
                            else "does not decay them"
                        )
                    )
                else:
                    message = (
                        f"weight decay added to the gradient (coupled, {-w:.3g} x p) on the torch "
                        f"side only at step {k}, for {_list(found)} (torch.optim.Adam/SGD "
                        f"weight_decay={_fmt(max(decay.values()))}); the JAX side does not couple it"
                    )
                return self.finding(
                    k,
                    "weight decay",
                    tuple(found),
                    "decoupled" if w > 0 else "coupled",
                    "coupled" if w > 0 else "not coupled",
                    message,
                    failing[worst],
                )
        # the clipping factor: the increment differs by a constant factor (seen first in the
        # first moment; a second moment that differs where the first agrees is not clipping)
        ratios = {} if quantity in ("mu", "trace") or "mu" not in t.state else None
        for path, (dt, dj, tol) in increments.items() if ratios is not None else ():
            r = _fit(dj, dt)
            if r is None:
                continue
            squared = quantity in ("nu", "nu_max")
            candidate = (max(r, 0.0) if squared else r) * dt
            r = float(np.sqrt(max(r, 0.0))) if squared else r
            fits = (
                _explains(dj, candidate, dt, tol)
                if path in failing
                else _excess(dj, candidate, tol) <= FIT
            )
            if not fits:
                ratios = None
                break
            ratios[path] = r
        if ratios:
            clip = self.explain_clip(k, ratios, failing[worst])
            if clip is not None:
                return clip
        tv, jv = t.state[quantity][worst], j.state[quantity][worst]
        index = int(np.argmax(np.abs(jv.astype(np.float64) - tv)))
        return self.finding(
            k,
            quantity,
            (worst,),
            float(tv.flat[index]),
            float(jv.flat[index]),
            f"{quantity} of {worst} ({self.layout.torch_name(worst)}) at step {k} "
            f"({self.scenario} gradients): torch {float(tv.flat[index]):.6g}, JAX "
            f"{float(jv.flat[index]):.6g} ({failing[worst]:.3g} x the tolerance)",
            failing[worst],
        )

    def explain_clip(self, k: int, ratios: dict[str, float], excess: float) -> Finding | None:
        t = self.t[k]
        values = np.array(list(ratios.values()))
        c_t = float(t.clip)
        if np.all(np.abs(values / np.median(values) - 1) < 1e-3):
            c_j = c_t * float(np.median(values))
            if abs(c_j - 1.0) < 1e-4:
                hint = "the JAX side does not clip"
                max_norm = c_t * (t.grad_norm or 0.0)
                norms = [float(np.linalg.norm(_clean(g))) / c_t for g in (t.grads or {}).values()]
                if c_t < 1 and norms and max(norms) < max_norm:
                    hint += (
                        f" here: every leaf's own norm (largest {max(norms):.3g}) is below the "
                        f"max norm, the global norm {_fmt(t.grad_norm)} above it: clipping per "
                        "parameter, or none"
                    )
            elif t.scale != 1.0 and abs(c_j * t.scale / c_t - 1) < 1e-2:
                hint = (
                    f"torch's / the loss scale {_fmt(t.scale)}: the JAX side clips the scaled "
                    "gradients (its clipping runs outside jaxamp.loss_scaled, before unscaling)"
                )
            elif abs(c_t - 1.0) < 1e-6:
                hint = "the JAX side clips where torch does not"
            else:
                hint = "another max norm or norm"
            return self.finding(
                k,
                "clip factor",
                tuple(sorted(ratios)),
                c_t,
                c_j,
                f"clip factor at step {k} ({self.scenario} gradients): torch {c_t:.4g}, JAX "
                f"{c_j:.4g} ({hint})",
                excess,
            )
        # per parameter: each leaf clipped by its own norm?
        per = {p: c_t * r for p, r in ratios.items()}
        unclipped = {p: _clean(t.grads[p]) / c_t for p in per}
        norms = {p: float(np.linalg.norm(g)) for p, g in unclipped.items()}
        # the max norm that explains the leaves the JAX side clipped
        clipped = {p: per[p] * norms[p] for p in per if per[p] < 1 - 1e-4}
        if clipped:
            max_norm = float(np.median(list(clipped.values())))
            expect = {p: min(max_norm / (norms[p] + 1e-6), 1.0) for p in per}
            if all(abs(expect[p] - per[p]) <= 1e-3 * max(per[p], 1e-12) for p in per):
                return self.finding(
                    k,
                    "clip factor",
                    tuple(sorted(per)),
                    c_t,
                    "per parameter",
                    f"clip factor at step {k} ({self.scenario} gradients): torch {c_t:.4g} "
                    f"(global norm {_fmt(t.grad_norm)}), JAX per parameter (each leaf clipped "
                    f"to norm {max_norm:.3g} by its own norm; e.g. "
                    + ", ".join(f"{p} {per[p]:.3g}" for p in sorted(per)[:3])
                    + ")",
                    excess,
                )
        return None

    # -- the update ------------------------------------------------------------------------------

    def direction(self, k: int, path: str) -> np.ndarray | None:
        t = self.t[k]
        if t.direction is not None:
            return t.direction[path].astype(np.float64)
        lr = float(t.lr.get(path, 0.0))
        return t.update[path].astype(np.float64) / lr if lr else None

    def explain_update(self, k: int, failing: dict[str, float]) -> Finding:
        t, j = self.t[k], self.j[k]
        worst = max(failing, key=failing.get)
        # the exact formula variants first (bias correction off is a per-step factor, which at
        # one step looks like another learning rate), then the rate, then weight decay
        for explain in (self.explain_adam, self.explain_sgd, self.explain_lr, self.explain_decay):
            found = explain(k, failing)
            if found is not None:
                return dataclasses.replace(found, excess=failing[worst])
        tv, jv = t.update[worst], j.update[worst]
        index = int(np.argmax(np.abs(jv.astype(np.float64) - tv)))
        return self.finding(
            k,
            "update",
            (worst,),
            float(tv.flat[index]),
            float(jv.flat[index]),
            f"update of {worst} ({self.layout.torch_name(worst)}) at step {k} ({self.scenario} "
            f"gradients): torch {float(tv.flat[index]):.6g}, JAX {float(jv.flat[index]):.6g} "
            f"({failing[worst]:.3g} x the tolerance; lr, state and clipping agree)",
            failing[worst],
        )

    def explain_lr(self, k: int, failing: dict[str, float]) -> Finding | None:
        t, j = self.t[k], self.j[k]
        groups: dict[str, list[str]] = {}
        for path in self.paths:
            groups.setdefault(repr(sorted(t.groups.get(path, {}).items())), []).append(path)
        for members in groups.values():
            if not any(p in failing for p in members):
                continue
            rates = []
            for path in members:
                d = self.direction(k, path)
                if d is None or not np.any(d):
                    continue
                c = _fit(j.update[path], d)
                if c is None:
                    return None
                tol = self.fit_tol(k, path)
                if path in failing:
                    if not _explains(j.update[path], c * d, t.update[path], tol):
                        return None
                elif _excess(j.update[path], c * d, tol) > FIT:
                    return None
                rates.append(c)
            if not rates:
                continue
            rates = np.array(rates)
            c = float(np.median(rates))
            if not np.all(np.abs(rates - c) <= 1e-4 * abs(c) + 1e-12):
                return None
            path = next(p for p in members if p in failing)
            lr_t = float(t.lr[path])
            lr_j = j.lr if isinstance(j.lr, float) else c
            if abs(lr_j - lr_t) <= 1e-5 * max(abs(lr_t), 1e-30):
                return None
            hint = " (warm-up)" if lr_t == 0.0 else ""
            close = lambda a, b: abs(a - b) <= 1e-4 * max(abs(a), abs(b), 1e-30)  # noqa: E731
            if t.lr_next is not None and close(lr_j, float(t.lr_next[path])):
                hint += (
                    f"; JAX's is torch's lr at step {k + 1}: the JAX schedule runs one step ahead "
                    "(torch reads the lr before scheduler.step(), optax at the update's count)"
                )
            elif k > 0 and close(lr_j, float(self.t[k - 1].lr[path])):
                hint += (
                    f"; JAX's is torch's lr at step {k - 1}: the JAX schedule runs one step behind"
                )
                skipped = [i for i in range(k) if self.t[i].skipped]
                if skipped:
                    hint += (
                        f" after the skipped step {skipped[0]} (torch's scheduler counts "
                        "iterations, skipped ones too; an optax schedule inside "
                        "jaxamp.loss_scaled counts applied updates)"
                    )
            return self.finding(
                k,
                "lr",
                tuple(members),
                lr_t,
                lr_j,
                f"lr at step {k}: torch {lr_t:.4g}{hint.split(';')[0]}, JAX {lr_j:.4g}"
                + (";" + hint.split(";", 1)[1] if ";" in hint else ""),
                0.0,
            )
        return None

    def explain_decay(self, k: int, failing: dict[str, float]) -> Finding | None:
        t, j = self.t[k], self.j[k]
        found = {}
        for path in failing:
            lr = float(t.lr.get(path, 0.0))
            if lr == 0.0:
                return None
            x = -lr * t.params[path].astype(np.float64)
            diff = j.update[path].astype(np.float64) - t.update[path]
            w = _fit(diff, x)
            if w is None or not _explains(diff, w * x, 0.0 * x, self.fit_tol(k, path)):
                return None
            found[path] = w
        only_jax, missing, other = [], [], []
        for path, w in found.items():
            wd = float(t.groups[path].get("weight_decay", 0.0))
            w_j = wd + w
            if wd == 0.0:
                only_jax.append((path, w_j))
            elif abs(w_j) < 1e-3 * wd:
                missing.append((path, wd))
            else:
                other.append((path, wd, w_j))
        parts = []
        if only_jax:
            parts.append(
                f"weight decay applied to {_list(p for p, _ in only_jax)} on the JAX side only "
                f"(JAX {only_jax[0][1]:.3g}; torch's param group has weight_decay=0)"
            )
        if missing:
            parts.append(
                f"weight decay not applied to {_list(p for p, _ in missing)} on the JAX side "
                f"(torch's param group: weight_decay={_fmt(missing[0][1])})"
            )
        if other:
            parts.append(
                f"weight decay of {_list(p for p, _, _ in other)}: torch {_fmt(other[0][1])}, "
                f"JAX {other[0][2]:.3g}"
            )
        first = (only_jax or missing or other)[0]
        return self.finding(
            k,
            "weight decay",
            tuple(found),
            float(t.groups[first[0]].get("weight_decay", 0.0)),
            float(float(t.groups[first[0]].get("weight_decay", 0.0)) + found[first[0]]),
            f"step {k}: " + "; ".join(parts),
            0.0,
        )

    def explain_adam(self, k: int, failing: dict[str, float]) -> Finding | None:
        t, j = self.t[k], self.j[k]
        if "mu" not in t.state or "nu" not in t.state or t.count is None:
            return None
        n = t.count
        variants = {
            "eps inside the square root (optax eps_root) on the JAX side, torch adds it outside": lambda m, v, vm, b1, b2, eps: (
                (m / (1 - b1**n)) / np.sqrt(v / (1 - b2**n) + eps)
            ),
            "eps inside and outside the square root on the JAX side (eps_root=eps), torch outside only": lambda m, v, vm, b1, b2, eps: (
                (m / (1 - b1**n)) / (np.sqrt(v / (1 - b2**n) + eps) + eps)
            ),
            "bias correction off on the JAX side (torch corrects both moments)": lambda m, v, vm, b1, b2, eps: (
                m / (np.sqrt(v) + eps)
            ),
            "AMSGrad on the JAX side only (the maximum of the second moment; torch's amsgrad=False)": lambda m, v, vm, b1, b2, eps: (
                (m / (1 - b1**n)) / (np.sqrt(vm[0] / (1 - b2**n)) + eps)
            ),
            "AMSGrad on the JAX side only (the maximum of the bias-corrected second moment, optax's; torch's amsgrad=False)": lambda m, v, vm, b1, b2, eps: (
                (m / (1 - b1**n)) / (np.sqrt(vm[1]) + eps)
            ),
        }
        quantity = {
            0: "eps placement",
            1: "eps placement",
            2: "bias correction",
            3: "amsgrad",
            4: "amsgrad",
        }
        for index, (name, formula) in enumerate(variants.items()):
            ok = True
            for path in failing:
                group = t.groups.get(path, {})
                if "betas" not in group or "eps" not in group:
                    return None
                b1, b2 = group["betas"]
                eps = float(group["eps"])
                lr = float(t.lr.get(path, 0.0))
                m = t.state["mu"][path].astype(np.float64)
                key = "nu_max" if group.get("amsgrad") and "nu_max" in t.state else "nu"
                v = t.state[key][path].astype(np.float64)
                vm = self.nu_max(k, path, b2)
                standard = (m / (1 - b1**n)) / (np.sqrt(v / (1 - b2**n)) + eps)
                with np.errstate(all="ignore"):
                    candidate = t.update[path] - lr * (formula(m, v, vm, b1, b2, eps) - standard)
                tol = self.fit_tol(k, path)
                if not _explains(j.update[path], candidate, t.update[path], tol):
                    ok = False
                    break
            if ok:
                worst = max(failing, key=failing.get)
                return self.finding(
                    k,
                    quantity[index],
                    tuple(failing),
                    "torch's",
                    "JAX's",
                    f"update at step {k} ({self.scenario} gradients) differs by {name}; "
                    f"first at {worst} ({self.layout.torch_name(worst)})",
                    0.0,
                )
        return None

    def nu_max(self, k: int, path: str, b2: float) -> tuple[np.ndarray, np.ndarray]:
        raw = corrected = None
        for i in range(k + 1):
            step = self.t[i]
            if step.skipped or "nu" not in step.state:
                continue
            v = step.state["nu"][path].astype(np.float64)
            hat = v / (1 - b2 ** max(step.count or 1, 1))
            raw = v if raw is None else np.maximum(raw, v)
            corrected = hat if corrected is None else np.maximum(corrected, hat)
        return raw, corrected

    def explain_sgd(self, k: int, failing: dict[str, float]) -> Finding | None:
        t, j = self.t[k], self.j[k]
        if "trace" not in t.state:
            return None
        for path in failing:
            group = t.groups.get(path, {})
            if "momentum" not in group:
                return None
            mom, lr = float(group["momentum"]), float(t.lr.get(path, 0.0))
            g = t.grads[path].astype(np.float64)
            if not group.get("maximize", False):
                g = g + float(group.get("weight_decay", 0.0)) * t.params[path]
            buf = t.state["trace"][path].astype(np.float64)
            other = -lr * buf if group.get("nesterov") else -lr * (g + mom * buf)
            if not _explains(j.update[path], other, t.update[path], self.fit_tol(k, path)):
                return None
        nesterov = bool(t.groups[next(iter(failing))].get("nesterov"))
        side = "torch" if nesterov else "JAX"
        return self.finding(
            k,
            "nesterov",
            tuple(failing),
            nesterov,
            not nesterov,
            f"update at step {k} differs by Nesterov momentum, on the {side} side only "
            f"(torch nesterov={nesterov})",
            0.0,
        )


def _list(paths) -> str:
    paths = list(paths)
    shown = ", ".join(paths[:4])
    return shown + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def first_difference(
    scenario: str, torch_steps: list[SideStep], jax_steps: list[SideStep], layout: Layout
) -> Finding | None:
    """The first (step, quantity) where the two sides of one replayed sequence part, named;
    None when every step agrees within float32 rounding."""
    return _Judge(scenario, torch_steps, jax_steps, layout).run()
