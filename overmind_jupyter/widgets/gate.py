"""`%overmind adapters VAR`: the adapter gate of a model, to switch, mix and compare adapters.

The panel is stock ipywidgets controls around two drawn parts:
- `GateView`: the gate's mode, and per adapter its routing, in-flight and queued requests (live, from
  `gate.state()`);
- the default adapter as toggle buttons (a click is `gate.switch(name)`);
- a mix row: a weight slider per adapter and a name (`gate.mix(weights, name=...)`, off the main thread);
- a prompt box: one generation per selected adapter, run concurrently through the gate, and `Outputs`
  showing them side by side as they finish.

The two drawn parts' views are labextension/src/widgets/gate.ts and outputs.ts, bundled into
widgets/static/ (see widgets/live.py).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import ipywidgets
import traitlets

from .live import LivePanel, LiveView, frontend, run_action, with_text
from .polling import poller

__all__ = ["AdapterPanel", "GateView", "Outputs", "gate_view"]

BASE = "__base__"  # the gate's name of the base model (adapters.routing.BASE, without importing torch here)
MIX_RANGE = (-1.0, 2.0)  # a mix slider's weights
CHOOSE_ROWS = 8  # the adapter list shows this many rows at most before it scrolls (the base model is first)


def gate_view(state: dict[str, Any]) -> dict[str, Any]:
    """The `gate` trait of `GateView` for one `gate.state()`.

    Returns:
        `dict` with `mode`, `kind`, `default`, `closed`, `exclusive`, `switches`, `blockers`, `engine`
        (None or its counters), and `adapters`: one row per adapter and the base model, each with `name`,
        `routing`, `in_flight`, `queued` (waiting for admission plus waiting in the batching engine),
        `oldest_wait_s`, `max_wait_s`, `wait` (the "Longest wait" cell: "1.2 s now" while requests wait,
        else the longest wait so far, or "none"), `default` and `active`.
    """
    engine = state.get("engine") or None
    engine_queued = (engine or {}).get("queued") or {}
    rows = []
    for name in [*state.get("adapters", []), BASE]:
        rows.append(_with_wait({
            "name": name,
            "routing": (state.get("routing") or {}).get(name, "?"),
            "in_flight": int((state.get("in_flight") or {}).get(name, 0)),
            "queued": int((state.get("queued") or {}).get(name, 0)) + int(engine_queued.get(name, 0)),
            "oldest_wait_s": round(float((state.get("oldest_wait_s") or {}).get(name, 0.0)), 1),
            "max_wait_s": round(float((state.get("max_wait_s") or {}).get(name, 0.0)), 3),
            "default": name == state.get("default"),
            "active": name in (state.get("active") or []),
        }))
    return {
        "mode": "closed" if state.get("closed") else str(state.get("mode", "")),
        "kind": str(state.get("kind", "")),
        "default": str(state.get("default", "")),
        "closed": bool(state.get("closed")),
        "exclusive": bool(state.get("exclusive")),
        "switches": int(state.get("switches") or 0),
        "blockers": {str(k): str(v) for k, v in (state.get("blockers") or {}).items()},
        "engine": None if engine is None else {
            "batches": engine.get("batches", 0), "rows": engine.get("rows", 0),
            "mean_batch_rows": round(float(engine.get("mean_batch_rows") or 0.0), 2),
            "largest_batch_rows": engine.get("largest_batch_rows", 0),
        },
        "adapters": rows,
    }


def _with_wait(row: dict[str, Any]) -> dict[str, Any]:
    """The "Longest wait" cell: the oldest waiting request's wait now, else the longest wait so far."""
    from kernel_server.formats import seconds_text

    if row["queued"]:
        row["wait"] = seconds_text(row["oldest_wait_s"]) + " now"
    else:
        row["wait"] = seconds_text(row["max_wait_s"]) if row["max_wait_s"] >= 0.05 else "none"
    return row


class GateView(LiveView):
    """The gate's mode and, per adapter, its routing, in-flight and queued requests.

    Traits (synced): `gate` (see `gate_view`), `title`, `error`, `notice` (the last switch, mix or
    generation's outcome).
    """

    gate = traitlets.Dict().tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)

    _esm, _css = frontend("gate")


class Outputs(LiveView):
    """The generations of one prompt, one column per adapter, side by side.

    Traits (synced): `prompt`, and `outputs`: one dict per adapter with `adapter`, `status` ("running",
    "done" or "error"), `text` (the new tokens decoded, or the error), `ids` (the new token ids, shown
    when they decode to nothing: special tokens, or a tokenizer that does not know them), `tokens` and
    `seconds`; `notice`: what Generate said instead of running (an empty prompt), shown above them.
    """

    prompt = traitlets.Unicode("").tag(sync=True)
    outputs = traitlets.List(traitlets.Dict()).tag(sync=True)

    _esm, _css = frontend("outputs")


class AdapterPanel(LivePanel):
    """The adapter panel of one gate: switch the default, mix adapters, compare generations side by side.

    Parts (attributes): `gate_view` (`GateView`), `default_picker` (`ToggleButtons`), `mix_sliders` (name
    to `FloatSlider`), `mix_name` (`Text`), `mix_button`, `prompt` (`Textarea`), `choose`
    (`SelectMultiple` of the adapters to run: the base model first, then the adapters, every row shown up to
    CHOOSE_ROWS), `choose_hint` (`HTML`: how to select several), `max_new_tokens` (`IntSlider`),
    `generate_button`, and `outputs` (`Outputs`). `close()` stops the updates and closes every part; the gate
    stays open.

    Args:
        gate: an `AdapterGate`.
        tokenizer: encodes the prompt and decodes the outputs; default: the tokenizer saved next to the
            model's checkpoint, if any; without one the prompt is read as token ids.
    """

    def __init__(self, gate: Any, tokenizer: Any = None, **kwargs: Any) -> None:
        self.gate = gate
        self.tokenizer = tokenizer
        self._tokenizer_looked = tokenizer is not None
        self._tokenizer_lock = threading.Lock()
        self._run = 0  # the latest comparison; results of an older one are dropped
        self._names: list[str] = []
        self._busy: set[str] = set()
        self._results: dict[str, dict[str, Any]] = {}
        self._results_prompt = ""
        self._results_lock = threading.Lock()
        self._results_changed = False
        self._last_state: dict[str, Any] | None = None
        self._following = threading.local()  # set while the panel moves the picker to the gate's default

        model = gate.model
        self.gate_view = GateView(title=f"Adapters of {type(model).__name__}")
        self.default_picker = ipywidgets.ToggleButtons(options=[BASE], description="default")
        self.default_picker.observe(self._on_pick, names="value")
        self.mix_sliders: dict[str, ipywidgets.FloatSlider] = {}
        self._slider_box = ipywidgets.HBox(layout=ipywidgets.Layout(flex_flow="row wrap"))
        self.mix_name = ipywidgets.Text(placeholder="name, e.g. fr_de", description="as",
                                        layout=ipywidgets.Layout(width="220px"))
        self.mix_button = ipywidgets.Button(description="Mix",
                                            tooltip="add the weighted combination as an adapter")
        self.mix_button.on_click(lambda _b: self.mix())
        self.prompt = ipywidgets.Textarea(placeholder="a prompt", description="prompt",
                                          layout=ipywidgets.Layout(width="60%", height="60px"))
        self.choose = ipywidgets.SelectMultiple(options=[BASE], description="adapters", rows=2,
                                                tooltip="Ctrl-click (Cmd-click on a Mac) selects several")
        self.choose_hint = ipywidgets.HTML(
            f"<small>Ctrl-click (Cmd-click on a Mac) or Shift-click to select several; {BASE} is the base "
            "model, without adapter</small>")
        self.max_new_tokens = ipywidgets.IntSlider(value=16, min=1, max=128, description="new tokens")
        self.generate_button = ipywidgets.Button(description="Generate", button_style="primary",
                                                 tooltip="one generation per selected adapter, side by side")
        self.generate_button.on_click(lambda _b: self.generate())
        self.outputs = Outputs()

        choose_box = ipywidgets.VBox([self.choose, self.choose_hint])
        layout = [
            ipywidgets.HTML(f"<b>Mix</b> (a new adapter: each slider is an adapter's weight, from {MIX_RANGE[0]:g} "
                            f"to {MIX_RANGE[1]:g}; 0 leaves it out, 1 takes it whole, a negative weight subtracts it)"),
            ipywidgets.HBox([self.mix_name, self.mix_button]),
            ipywidgets.HTML("<b>Compare</b> (one generation per selected adapter)"),
            ipywidgets.HBox([self.prompt, choose_box]),
            ipywidgets.HBox([self.max_new_tokens, self.generate_button]),
        ]
        mix_row = ipywidgets.VBox([layout[0], self._slider_box, layout[1]])
        prompt_row = ipywidgets.VBox(layout[2:])
        super().__init__(children=[self.gate_view, self.default_picker, mix_row, prompt_row, self.outputs],
                         views=[self.gate_view, self.outputs], **kwargs)
        self.own(self.default_picker, self._slider_box, self.mix_name, self.mix_button, self.prompt,
                 self.choose, self.choose_hint, choose_box, self.max_new_tokens, self.generate_button, *layout,
                 mix_row, prompt_row)
        self.update(gate.state())  # shown complete at once; the poller keeps it so
        self.subscribe(("gate", id(gate)), gate.state, self.update)

    # -- what the controls do (from the main thread; the work runs off it) ----------------------------------

    def switch(self, name: str) -> None:
        """Make `name` the gate's default adapter (`gate.switch`); instant, it moves no weights."""
        try:
            self.gate.switch(name)
        except Exception as exc:  # noqa: BLE001 - shown in the panel: an unknown name, a closed gate
            self.gate_view.tell(f"could not switch to {name}: {exc}")
            return
        self.gate_view.tell(f"default adapter: {name}")

    def mix(self, weights: dict[str, float] | None = None,
            name: str | None = None) -> threading.Thread | None:
        """Add the weighted combination as a new adapter (`gate.mix`) off the main thread.

        Args:
            weights: adapter to weight; default: the sliders' non-zero values.
            name: the new adapter's name; default: the name box, or one made of the weights.

        Returns:
            The thread doing it (None when there was nothing to mix).
        """
        if weights is None:
            weights = {n: s.value for n, s in self.mix_sliders.items() if s.value != 0}
        if not weights:
            self.gate_view.tell("set a weight on at least one adapter to mix")
            return None
        name = name or self.mix_name.value.strip() or "mix_" + "_".join(sorted(weights))
        spelled = " + ".join(f"{w:g} {n}" for n, w in weights.items())
        self._busy.add("mix")
        self.mix_button.disabled = True

        def act() -> None:
            try:
                self.gate.mix(weights, name=name)
            except Exception as exc:  # noqa: BLE001 - shown in the panel: an existing name, a non-LoRA adapter, ...
                self.gate_view.tell(f"could not mix {spelled}: {exc}")
            else:
                self.gate_view.tell(f"mixed {spelled} as {name}")
            finally:
                self._busy.discard("mix")
                poller().kick()

        return run_action("mix", act)

    def generate(self, prompt: str | None = None, adapters: list[str] | None = None,
                 max_new_tokens: int | None = None) -> list[threading.Thread]:
        """Run one generation per adapter through the gate, concurrently, off the main thread.

        Args:
            prompt: default: the prompt box.
            adapters: default: the selected adapters (the gate's default when none is selected).
            max_new_tokens: default: the slider.

        Returns:
            The threads (one per adapter); `outputs.outputs` shows each result as it finishes; none for an
            empty prompt: the panel says a prompt is needed, and the model is not called.
        """
        prompt = self.prompt.value if prompt is None else prompt
        if not prompt.strip():
            self.outputs.tell("type a prompt first: Generate continues it, once per selected adapter")
            return []
        self.outputs.tell("")  # a notice of an earlier empty prompt goes
        names = list(adapters if adapters is not None else self.choose.value) or [self.gate.default]
        limit = int(max_new_tokens if max_new_tokens is not None else self.max_new_tokens.value)
        with self._results_lock:
            self._run += 1
            run = self._run
            self._results = {n: {"adapter": n, "status": "running", "text": "", "tokens": 0, "seconds": 0.0}
                             for n in names}
            self._results_prompt = prompt
            self._results_changed = True
        self._busy.add("generate")
        self.generate_button.disabled = True
        poller().kick()
        return [run_action(f"generate-{n}", functools.partial(self._generate_one, run, prompt, n, limit))
                for n in names]

    def _generate_one(self, run: int, prompt: str, name: str, limit: int) -> None:
        started = time.perf_counter()
        try:
            ids, mask, decode = self._encode(prompt)
            kwargs: dict[str, Any] = {"max_new_tokens": limit, "do_sample": False}
            config = getattr(self.gate.model, "generation_config", None)
            pad = getattr(self.tokenizer, "pad_token_id", None)
            if config is not None and getattr(config, "pad_token_id", None) is None and pad is not None:
                kwargs["pad_token_id"] = pad
            out = self.gate.generate(input_ids=ids, attention_mask=mask, adapter=name, **kwargs)
            new = out[0, ids.shape[1]:].tolist()
            result = {"status": "done", "text": decode(new), "ids": new, "tokens": len(new)}
        except Exception as exc:  # noqa: BLE001 - shown in the column of that adapter
            result = {"status": "error", "text": f"{type(exc).__name__}: {exc}", "tokens": 0}
        result.update(adapter=name, seconds=round(time.perf_counter() - started, 3))
        with self._results_lock:
            if run == self._run and name in self._results:
                self._results[name] = result
                self._results_changed = True
                if all(r["status"] != "running" for r in self._results.values()):
                    self._busy.discard("generate")
        poller().kick()

    def _encode(self, prompt: str) -> tuple[Any, Any, Any]:
        """The prompt as input ids and attention mask on the model's device, and a decoder of new ids."""
        import torch

        tokenizer = self._find_tokenizer()
        device = next(self.gate.model.parameters()).device
        if tokenizer is None:
            try:
                ids = [int(t) for t in prompt.split()]
            except ValueError:
                raise ValueError("no tokenizer: give one (`%overmind adapters VAR --tokenizer TOKVAR`, or "
                                 "`adapter_panel(model, tokenizer)`), or type token ids") from None
            if not ids:
                raise ValueError("the prompt is empty")
            tensor = torch.tensor([ids], device=device)
            return tensor, torch.ones_like(tensor), lambda new: " ".join(map(str, new))
        encoded = tokenizer(prompt, return_tensors="pt")
        ids = encoded["input_ids"].to(device)
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty")
        mask = encoded.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.to(device)
        return ids, mask, lambda new: tokenizer.decode(new, skip_special_tokens=True)

    def _find_tokenizer(self) -> Any:
        """The tokenizer given, else one saved next to the model's checkpoint (looked for once)."""
        with self._tokenizer_lock:
            return self._look_for_tokenizer()

    def _look_for_tokenizer(self) -> Any:
        if not self._tokenizer_looked:
            self._tokenizer_looked = True
            config = getattr(self.gate.model, "config", None)
            path = str(getattr(config, "name_or_path", "") or "")
            files = ("tokenizer.json", "tokenizer_config.json")
            if path and os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in files):
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(path)
        return self.tokenizer

    def _on_pick(self, change: dict[str, Any]) -> None:
        # the panel moves the picker to follow the gate; only a user's click switches
        if getattr(self._following, "on", False) or change["new"] is None:
            return
        if change["new"] != self.gate.default:
            self.switch(change["new"])

    # -- updates (on the poller's thread) -------------------------------------------------------------------

    def update(self, state: dict[str, Any] | None, error: Exception | None = None) -> None:
        """Show one `gate.state()`: the table, the adapter lists of the controls, the outputs."""
        view = self.gate_view
        with self.outputs.hold_sync():
            self.outputs.take_notice()
        with view.hold_sync():
            view.take_notice()
            if error is not None or state is None:
                view.error = f"cannot read the gate: {error}"
                return
            self._last_state = state
            view.error = ""
            view.gate = gate_view(state)
        self._sync_names(state)
        closed = bool(state.get("closed"))
        controls = (self.default_picker, self.mix_button, self.generate_button, self.choose, self.mix_name)
        for control in controls:
            control.disabled = closed
        if not closed:
            self.mix_button.disabled = "mix" in self._busy
            self.generate_button.disabled = "generate" in self._busy
        with self._results_lock:
            changed, self._results_changed = self._results_changed, False
            results = [dict(r) for r in self._results.values()]
            prompt = self._results_prompt
        if changed:
            with self.outputs.hold_sync():
                self.outputs.prompt = prompt
                self.outputs.outputs = results

    def _sync_names(self, state: dict[str, Any]) -> None:
        self._following.on = True
        try:
            self._follow(state)
        finally:
            self._following.on = False

    def _follow(self, state: dict[str, Any]) -> None:
        names = [*state.get("adapters", []), BASE]
        if names != self._names:
            self._names = names
            selected = tuple(n for n in self.choose.value if n in names) or (state.get("default", BASE),)
            # the base model first and every row in sight: listed last, it hid below the fold
            self.choose.options = [BASE, *(n for n in names if n != BASE)]
            self.choose.value = selected
            self.choose.rows = max(2, min(len(names), CHOOSE_ROWS))
            self.default_picker.options = names
            for name in [n for n in self.mix_sliders if n not in names]:
                self.mix_sliders.pop(name).close()
            for name in names:
                if name != BASE and name not in self.mix_sliders:
                    self.mix_sliders[name] = ipywidgets.FloatSlider(
                        value=0.0, min=MIX_RANGE[0], max=MIX_RANGE[1], step=0.05, description=name,
                        readout_format=".2f",
                        tooltip=f"weight of {name} in the mix ({MIX_RANGE[0]:g} to {MIX_RANGE[1]:g})",
                        layout=ipywidgets.Layout(width="300px"))
            self._slider_box.children = [self.mix_sliders[n] for n in names if n in self.mix_sliders]
        default = state.get("default")
        if default in names and self.default_picker.value != default:
            self.default_picker.value = default

    def close(self) -> None:
        sliders = list(self.mix_sliders.values())
        self.mix_sliders.clear()
        try:
            super().close()
        finally:
            for slider in sliders:
                slider.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        lines = [repr(self.gate)]
        for row in gate_view(self._last_state or self.gate.state())["adapters"]:
            lines.append(f"  {row['name']:<16} {row['routing']:<9} in flight {row['in_flight']}  "
                         f"queued {row['queued']}" + ("  (default)" if row["default"] else ""))
        return with_text(super()._repr_mimebundle_(**kwargs), "\n".join(lines))
