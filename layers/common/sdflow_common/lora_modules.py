"""Which `training.lora.target_modules` a family's denoiser takes, matched as the training image matches them.

The image adds the adapter with diffusers' `add_adapter`, that is peft's `inject_adapter_in_model` with a
`LoraConfig(target_modules=[...])` (sdflow_image.training.lora). peft (0.13 on the colossalai image, 0.21 on
the accelerate one; `check_target_module_exists`) takes a module when its full name equals a target or ends
with "." + the target, and refuses a module it takes whose class it cannot adapt ("Target module … is not
supported"; of a denoiser's modules it adapts Linear and Conv2d). So a target is valid when it names at least
one adaptable module and no other one. peft itself fails only when no target of the list matches anything; a
list whose other entries match would silently leave a misspelt one out, so Validate run refuses every target
that names no module.

The denoisers' module names (lora_module_names, generated from the real model classes built at full size on the
meta device, and held equal to them by tests/image/test_lora_module_names.py and
tests/image_accelerate/test_lora_module_names_next.py) are written as templates: `down_blocks.{0-2}.resnets.
{0-1}.conv1` stands for the six names of every combination of the braced indices."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable

from sdflow_common.lora_module_names import ADAPTABLE, OTHER

Component = str | frozenset[int]


def model_key(family: str, variant: str = "") -> str:
    """The key of lora_module_names for a family's model (memory_estimate.reference's variants: "" its largest)."""
    return f"{family}-{variant}" if variant else family


def _indices(text: str) -> list[int]:
    found: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        found.extend(range(int(low), int(high or low) + 1))
    return found


def expand(templates: Iterable[str]) -> set[str]:
    """Every module name the templates stand for."""
    names: set[str] = set()
    for template in templates:
        choices = [
            [str(i) for i in _indices(part[1:-1])] if part.startswith("{") else [part] for part in template.split(".")
        ]
        names.update(".".join(combination) for combination in itertools.product(*choices))
    return names


def _show(component: Component) -> str:
    if isinstance(component, str):
        return component
    ordered = sorted(component)
    if len(ordered) == 1:
        return str(ordered[0])
    runs: list[tuple[int, int]] = []
    for index in ordered:
        if runs and index == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return "{" + ",".join(f"{low}-{high}" if low != high else str(low) for low, high in runs) + "}"


def _merge_once(items: set[tuple[Component, ...]]) -> bool:
    """Merge names that differ only in one index position; whether any merged."""
    for length in sorted({len(item) for item in items}):
        for position in range(length):
            groups: dict[tuple[Component, ...], list[tuple[Component, ...]]] = defaultdict(list)
            for item in items:
                if len(item) == length and not isinstance(item[position], str):
                    groups[item[:position] + item[position + 1 :]].append(item)
            for rest, members in groups.items():
                if len(members) > 1:
                    merged: frozenset[int] = frozenset()
                    for member in members:
                        index = member[position]
                        assert not isinstance(index, str)  # grouped on index positions only
                        merged |= index
                    items.difference_update(members)
                    items.add((*rest[:position], merged, *rest[position:]))
                    return True
    return False


def compress(names: Iterable[str]) -> tuple[str, ...]:
    """Templates standing for exactly `names` (expand(compress(names)) == set(names)); for the generator and the
    tests that hold lora_module_names equal to the real models."""
    items: set[tuple[Component, ...]] = {
        tuple(frozenset([int(part)]) if part.isdigit() else part for part in name.split(".")) for name in names
    }
    while _merge_once(items):
        pass
    return tuple(sorted(".".join(_show(part) for part in item) for item in items))


def relevant_other(adaptable: Iterable[str], other: Iterable[str]) -> set[str]:
    """The non-adaptable module names a target could name together with an adaptable one: only those whose last
    part is also an adaptable module's last part (a target matches a name's dotted tail, so two names share a
    target only when they share their last part)."""
    leaves = {name.rsplit(".", 1)[-1] for name in adaptable}
    return {name for name in other if name.rsplit(".", 1)[-1] in leaves}


def split_names(modules: Iterable[tuple[str, bool]]) -> tuple[set[str], set[str]]:
    """A model's (name, whether peft adapts it) pairs, from `named_modules()` without the root's "", as
    (adaptable names, relevant_other names): what lora_module_names holds of it."""
    pairs = list(modules)
    adaptable = {name for name, adapts in pairs if adapts}
    return adaptable, relevant_other(adaptable, (name for name, adapts in pairs if not adapts))


def _matches(target: str, name: str) -> bool:
    return name == target or name.endswith(f".{target}")


class ModuleNames:
    """One denoiser's module names: those LoRA adapts and the others a target could also name."""

    def __init__(self, adaptable: set[str], other: set[str]) -> None:
        self.adaptable, self.other = adaptable, other

    def problem(self, target: str) -> str | None:
        """Why the image would not adapt `target`, or None when it would."""
        clash = next((name for name in sorted(self.other) if _matches(target, name)), None)
        if clash is not None:
            return f"'{target}' also names {clash}, a module LoRA cannot adapt (peft adapts Linear and Conv2d layers)"
        if not any(_matches(target, name) for name in self.adaptable):
            return f"'{target}' names no Linear or Conv2d module"
        return None

    def leaf_names(self) -> list[str]:
        """The adaptable modules' short names (what a target usually is: `to_q` adapts every `….to_q`) that name
        no other module."""
        found = set()
        for name in self.adaptable:
            parts = name.split(".")
            # `to_out.0`: a last part that is an index is no name on its own.
            short = ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
            if self.problem(short) is None:
                found.add(short)
        return sorted(found)


def module_names(family: str, variant: str = "") -> ModuleNames | None:
    """The family's denoiser modules; None for a model this table does not hold."""
    key = model_key(family, variant)
    if key not in ADAPTABLE:
        return None
    return ModuleNames(expand(ADAPTABLE[key]), expand(OTHER[key]))
