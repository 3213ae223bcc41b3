"""A whole-model trace across the process boundary: what the model is given (TraceView, in its worker) and what
the run answers it (TraceServer, beside the golden).

A whole-model backend runs a trace by its own wiring (WholeModelBackend.evaluate_trace). It is handed a TraceView
where a golden used to be: the case's kwargs, the weights and the tokens. What teacher forcing needs comes one
question at a time, while the trace runs:
- `feed`: in the layer-by-layer mode, a layer's golden input state (AttnRes blocks and prefix, the layer's cache),
  or the state the LM head reads (`step<s>.final`). Each question carries the outputs the model recorded since its
  last one (the view watches the dict the model records into: `watch`), and the run answers only when every
  output computed before that point is among them. The golden's state after layer l tells what layer l should
  have output; the model has committed its own by then, and its final outputs must be those it committed.
- `route`: at a MoE layer, the golden's router margins and, for the tokens whose margin is below the precision's
  budget (a near-tie), the golden's choice; -1 for the other tokens. The run counts the tokens so forced.
A timed run is given the route answers of the judged run as a table, so that nothing is asked while the clock runs.
The golden's outputs are never sent: `group("outputs")` raises.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from conformance.cases.trace_names import TraceName
from conformance.golden.errors import GoldenError

Ask = Callable[[dict, dict], tuple[dict, dict]]
_KEY = re.compile(r"step(\d+)\.(layer(\d+)|final)")
_LAST = 1 << 20   # a position past every layer: the final state, then the step's logits and token


def key_position(key: str) -> tuple[int, int]:
    """(step, layer) of a feed key `step<s>.layer<ll>`, (step, _LAST) of `step<s>.final`; ValueError otherwise."""
    m = _KEY.fullmatch(key)
    if m is None:
        raise ValueError(f"expected a key like 'step1.layer02' or 'step1.final', found {key[:80]!r}")
    return int(m.group(1)), (int(m.group(3)) if m.group(3) is not None else _LAST)


def output_position(name: str) -> tuple[int, int] | None:
    """Where a trace output is computed, comparable with key_position: (step, layer) for a layer's tensor, after
    the step's final state for its logits and token; None for a name that is no trace output."""
    parsed = TraceName.parse(name)
    if parsed is None:
        return None
    return (parsed.step, parsed.layer) if parsed.layer is not None else (parsed.step, _LAST + 1)


def _split(name: str) -> tuple[str, str]:
    """'step1.layer02.prefix' -> ('step1.layer02', 'prefix'); KeyError for a name of no feed key."""
    head, _, rest = name.partition(".")
    mid, _, rest = rest.partition(".")
    key = f"{head}.{mid}"
    if not rest or _KEY.fullmatch(key) is None:
        raise KeyError(name)
    return key, rest


class TraceView:
    """What a whole-model backend is given for one trace, in its worker (see the module docstring). It answers
    the calls a golden answered (`kwargs`, `require`, `group`), serving `group("inter")` one key at a time."""

    path = "(a golden of the run: its inputs only, each layer's state served in order)"

    def __init__(self, ask: Ask, kwargs: Mapping, weights: Mapping[str, np.ndarray], tokens: np.ndarray,
                 routes: Mapping[str, Mapping[str, np.ndarray]] | None = None):
        """ask(header, arrays) -> (reply, arrays): a question to the run; routes: the route answers of a judged
        run (key -> {'margin', 'choice'}), for a timed run that may not ask."""
        self.kwargs = dict(kwargs)
        self._ask, self._weights, self._tokens, self._routes = ask, dict(weights), tokens, routes
        self._fed: dict[str, dict[str, np.ndarray]] = {}
        self._asked_routes: dict[str, dict[str, np.ndarray]] = {}
        self._sent: set[str] = set()
        self._record: Mapping[str, object] = {}

    def require(self, names: list[str]) -> None:
        for name in names:
            known = name == "inputs.tokens" or (name.startswith("weights.") and name[len("weights."):] in
                                                self._weights)
            if not known:
                raise GoldenError(f"{name}: not among what a whole-model backend is given (the weights, "
                                  "inputs.tokens, and each layer's golden input as it is reached)")

    def group(self, name: str) -> Mapping[str, np.ndarray]:
        if name == "weights":
            return dict(self._weights)
        if name == "inputs":
            return {"tokens": self._tokens}
        if name == "inter":
            return LazyInter(self)
        raise GoldenError(f"group {name!r}: a backend is given a golden's inputs, never its {name}")

    def watch(self, record: Mapping[str, object]) -> None:
        """The dict the model records its outputs into; each question to the run carries what it gained since
        the last one."""
        self._record = record

    def feed(self, key: str) -> dict[str, np.ndarray]:
        if key not in self._fed:
            new = {k: np.asarray(v) for k, v in self._record.items() if k not in self._sent}
            _, arrays = self._ask({"op": "feed", "key": key, "names": sorted(new)},
                                  {f"c.{k}": v for k, v in new.items()})
            self._sent.update(new)
            self._fed[key] = {k[len("f."):]: v for k, v in arrays.items() if k.startswith("f.")}
        return self._fed[key]

    def route(self, key: str) -> dict[str, np.ndarray]:
        if self._routes is not None:
            return dict(self._routes.get(key, {}))
        if key not in self._asked_routes:
            _, arrays = self._ask({"op": "route", "key": key}, {})
            self._asked_routes[key] = dict(arrays)
        return self._asked_routes[key]


class LazyInter(Mapping):
    """`group("inter")` of a TraceView: a layer's state entries (`step1.layer02.prefix`, `...kda.recurrent`) and a
    MoE layer's route entries (`route.step1.layer04.margin`, `.choice`), each fetched when first asked for."""

    def __init__(self, view: TraceView):
        self.view = view

    def __getitem__(self, name: str) -> np.ndarray:
        if not isinstance(name, str):
            raise KeyError(name)
        if name.startswith("route."):
            key, _, field = name[len("route."):].rpartition(".")
            return self.view.route(key)[field]
        key, rest = _split(name)
        return self.view.feed(key)[rest]

    def __iter__(self) -> Iterator[str]:
        raise GoldenError("a golden's intermediates are served one key at a time, in compute order: ask for a key")

    def __len__(self) -> int:
        raise GoldenError("a golden's intermediates are served one key at a time, in compute order: ask for a key")


class TraceRefused(RuntimeError):
    """A whole model asked for what it may not have yet; the message says what it had not recorded."""


class TraceServer:
    """The run's answers to a whole model's questions about one trace (see the module docstring)."""

    def __init__(self, golden, router_budget: float):
        self.inter = golden.group("inter")
        self.outputs = sorted(golden.group("outputs"))
        self.budget = router_budget
        self.committed: dict[str, np.ndarray] = {}
        self.forced = 0
        self.routes: dict[str, dict[str, np.ndarray]] = {}   # the near-tie answers given, for the timed runs

    def answer(self, header: dict, arrays: dict) -> tuple[dict, dict]:
        op = header.get("op")
        if op == "feed":
            return self._feed(str(header.get("key")), arrays)
        if op == "route":
            return self._route(str(header.get("key")))
        raise TraceRefused(f"unknown question {str(op)[:40]!r}: expected feed or route")

    def _feed(self, key: str, arrays: dict) -> tuple[dict, dict]:
        try:
            at = key_position(key)
        except ValueError as e:
            raise TraceRefused(f"feed: {e}") from None
        for name, value in arrays.items():
            out = name[len("c."):]
            if not name.startswith("c.") or out not in self.outputs or out in self.committed:
                raise TraceRefused(f"feed {key}: recorded {out[:80]!r}, which is no trace output of this golden or "
                                   "was recorded before")
            self.committed[out] = value
        missing = [n for n in self.outputs if (output_position(n) or at) < at and n not in self.committed]
        if missing:
            raise TraceRefused(f"asked for the golden input of {key} before recording {missing[0]} (and "
                               f"{len(missing) - 1} more): a layer's golden input is given after the outputs computed "
                               "before it (TraceView.watch)")
        prefix = key + "."
        return {"op": "fed"}, {f"f.{k[len(prefix):]}": v for k, v in self.inter.items() if k.startswith(prefix)}

    def _route(self, key: str) -> tuple[dict, dict]:
        try:
            key_position(key)
        except ValueError as e:
            raise TraceRefused(f"route: {e}") from None
        margin = self.inter.get(f"route.{key}.margin")
        if margin is None or self.budget <= 0 or not (np.asarray(margin) < self.budget).any():
            return {"op": "routed"}, {}
        near = np.asarray(margin) < self.budget
        choice = np.where(near[:, None], np.asarray(self.inter[f"route.{key}.choice"], np.int64), -1)
        self.forced += int(near.sum())
        self.routes[key] = {"margin": np.asarray(margin), "choice": choice}
        return {"op": "routed"}, dict(self.routes[key])

    def check_final(self, outputs: Mapping[str, np.ndarray]) -> None:
        """TraceRefused when the trace's final outputs differ from what it recorded before the next layer was fed."""
        for name, value in self.committed.items():
            final = outputs.get(name)
            if final is None or np.shape(final) != np.shape(value) or not np.array_equal(
                    np.asarray(final), np.asarray(value), equal_nan=np.asarray(value).dtype.kind == "f"):
                raise TraceRefused(f"its final {name} differs from the {name} it had recorded when it asked for the "
                                   "next layer's golden input")
