"""The `Overmind` configurable: `c.Overmind.<name>` in IPython config for each setting a kernel reads or
hands to the daemon it starts. Every trait is made from its declaration in kernel_server/settings.py.

traitlets' order holds: the command line over the config file over the environment, which gives each
trait its default. A bad value, from any of them, is reported once and replaced by the default (Note
[Bad settings] in kernel_server/settings.py): `%load_ext` never fails on one.
"""

from __future__ import annotations

import os
from typing import Any

from traitlets import TraitType
from traitlets.config import Configurable

from kernel_server import settings as declared
from kernel_server.settings import Setting, SettingError

__all__ = ["Overmind"]


class _Declared(TraitType[Any, Any]):
    """A trait whose default comes from the environment and whose values go through the setting's kind."""

    def __init__(self, setting: Setting) -> None:
        super().__init__(help=f"{setting.help[0].upper()}{setting.help[1:]} (environment: {setting.env}).",
                         config=True)
        self.setting = setting
        self.info_text = f"like {setting.example}"

    def default(self, obj: Any = None) -> Any:
        return declared.get(self.setting)

    def validate(self, obj: Any, value: Any) -> Any:
        try:
            return self.setting.parse(value, source=f"c.Overmind.{self.setting.name}")
        except SettingError as exc:
            declared.report(exc, self.setting)
            return declared.get(self.setting)


class Overmind(Configurable):
    """Settings of the overmind_jupyter extension (README, "Configuration")."""

    # A trait for each setting not read by the server alone, named by hand: traits made in a loop over
    # declared.SETTINGS would be unknown to mypy, which checks `config.wait_timeout` and the rest where
    # they are read (tests/test_settings.py checks that the two lists agree).
    enabled = _Declared(declared.ENABLED)
    home = _Declared(declared.HOME)
    budget = _Declared(declared.BUDGET)
    wait_timeout = _Declared(declared.WAIT_TIMEOUT)
    arena = _Declared(declared.ARENA)
    arena_dir = _Declared(declared.ARENA_DIR)
    disk_reserve = _Declared(declared.DISK_RESERVE)
    populate = _Declared(declared.POPULATE)
    compact = _Declared(declared.COMPACT)
    fake_gpus = _Declared(declared.FAKE_GPUS)
    gpu_reserve = _Declared(declared.GPU_RESERVE)
    units_timeout = _Declared(declared.UNITS_TIMEOUT)
    device_copier = _Declared(declared.DEVICE_COPIER)
    device_copy_idle = _Declared(declared.DEVICE_COPY_IDLE)
    warm_devices = _Declared(declared.WARM_DEVICES)  # read by a warm kernel started ahead (warm/warmup.py)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name in self.trait_names(config=True):
            getattr(self, name)  # every bad value is reported now, when the extension loads, not later

    def apply(self) -> None:
        """Hand the settings to the cached call, and write each that config changed into this process's
        environment, where the daemon and preload workers this kernel starts, and the units calls, read it."""
        from .loading import options

        options.wait_timeout = self.wait_timeout
        options.backing = self.arena
        options.populate = self.populate
        for setting in declared.SETTINGS:
            if setting.read_by != "server":
                value = getattr(self, setting.name)
                if value != declared.get(setting):
                    os.environ[setting.env] = _text(value)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
