"""FP8 recipes (engine/fp8_recipe.h): how a layer's GEMM inputs are scaled into
FP8, as plain values. Equal recipes built separately are equal and hash alike;
a layer given one runs its GEMMs in FP8 (Note [FP8 Linear] in layers/linear.h).

    recipe = sg.Fp8Recipe.delayed(amax_history_len=16)
    layer = sg.Linear(ctx, 1024, 1024, fp8=recipe)

scaling: "current" (the scale from this very tensor's amax), "delayed" (from
the amax history of earlier steps, kept and updated inside the captured step)
or "block" (a scale per 1 x 128 block of activations and gradients and per
128 x 128 block of weights). formats: "hybrid" (E5M2 gradients) or "e4m3".
A field of the wrong kind or name raises when the recipe is made, a number out of the
engine's range when a layer is built with it. on_non_finite: "skip_step" (default: the
quantization keeps its scales and the step goes on) or "stop" (the layer's check_errors()
raises StepGraphError; its eager forward and backward call it, a captured step's caller
calls it after replay()).
"""

import ctypes
import dataclasses

from stepgraph import _capi, _checks

_SCALINGS = {"current": 0, "delayed": 1, "block": 2}


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    scaling: str = "current"
    formats: str = "hybrid"
    amax_history_len: int = 1024
    amax_reduction: str = "max"  # delayed: "max" of the history or its "most_recent" entry
    margin: int = 0
    power_of_two_scales: bool = True
    fast_accumulation_forward: bool = True
    fast_accumulation_backward: bool = False
    on_non_finite: str = "skip_step"  # or "stop"

    @classmethod
    def current(cls, **fields):
        return cls._default("current", fields)

    @classmethod
    def delayed(cls, **fields):
        return cls._default("delayed", fields)

    @classmethod
    def block(cls, **fields):
        return cls._default("block", fields)

    @classmethod
    def _default(cls, scaling, fields):
        c = _capi.Fp8Recipe()
        _capi.lib().sg_fp8_recipe_default(ctypes.byref(c), _SCALINGS[scaling])
        defaults = cls(scaling=scaling, formats="hybrid" if c.hybrid else "e4m3",
                       amax_history_len=c.amax_history_len,
                       amax_reduction="most_recent" if c.amax_most_recent else "max", margin=c.margin,
                       power_of_two_scales=bool(c.power_of_two_scales),
                       fast_accumulation_forward=bool(c.fast_accumulation_forward),
                       fast_accumulation_backward=bool(c.fast_accumulation_backward),
                       on_non_finite="stop" if c.stop_on_non_finite else "skip_step")
        return dataclasses.replace(defaults, **fields)

    def __post_init__(self):
        self._to_c("Fp8Recipe")  # a bad field is refused where it is written
        # Fields the engine ignores for this scaling (engine/fp8_recipe.h) must keep their defaults,
        # so that a value set there is not dropped silently.
        common = _capi.Fp8Recipe()
        _capi.lib().sg_fp8_recipe_default(ctypes.byref(common), _SCALINGS["current"])
        only = {"amax_history_len": ("delayed", common.amax_history_len),
                "amax_reduction": ("delayed", "most_recent" if common.amax_most_recent else "max"),
                "margin": ("delayed", common.margin),
                "power_of_two_scales": ("block", bool(common.power_of_two_scales))}
        for name, (scaling, default) in only.items():
            if self.scaling != scaling and getattr(self, name) != default:
                raise _checks.ArgumentError(f"Fp8Recipe: {name}={getattr(self, name)!r} applies to {scaling} "
                                            f"scaling only; a {self.scaling} recipe ignores it, so leave it at "
                                            f"{default!r}")

    def _to_c(self, owner):
        """The sg_fp8_recipe of this recipe; names and types checked here, ranges by the engine."""
        def choice(name, value, allowed):
            return allowed[_checks.check_choice(f"fp8.{name}", value, allowed, owner)]
        c = _capi.Fp8Recipe()
        c.scaling = choice("scaling", self.scaling, _SCALINGS)
        c.hybrid = choice("formats", self.formats, {"hybrid": 1, "e4m3": 0})
        c.amax_history_len = _checks.check_int("fp8.amax_history_len", self.amax_history_len, *_checks.INT32, owner)
        c.amax_most_recent = choice("amax_reduction", self.amax_reduction, {"max": 0, "most_recent": 1})
        # on_non_finite "stop": the layer's check_errors raises once a quantization met a NaN or an
        # infinity (eager forward and backward call it; after a replay, call it yourself).
        c.margin = _checks.check_int("fp8.margin", self.margin, *_checks.INT32, owner)
        for name in ("power_of_two_scales", "fast_accumulation_forward", "fast_accumulation_backward"):
            setattr(c, name, _checks.check_flag(f"fp8.{name}", getattr(self, name), owner))
        c.stop_on_non_finite = choice("on_non_finite", self.on_non_finite, {"skip_step": 0, "stop": 1})
        return c
