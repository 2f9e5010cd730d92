"""The `Overmind` configurable: IPython config (`c.Overmind.enabled = True`) with an env override each."""

from __future__ import annotations

import os
from typing import Any

from traitlets import Bool, Enum, Float, Unicode
from traitlets.config import Configurable

__all__ = ["Overmind"]

# trait name -> environment variable that overrides it
ENV = {
    "enabled": "OVERMIND_ENABLED",
    "home": "OVERMIND_HOME",
    "budget": "OVERMIND_BUDGET",
    "wait_timeout": "OVERMIND_WAIT_TIMEOUT",
    "arena": "OVERMIND_ARENA",
    "populate": "OVERMIND_POPULATE",
}


class Overmind(Configurable):
    """Settings of the overmind_jupyter extension. Each has an environment override (see `ENV`)."""

    enabled = Bool(False, help="Turn the cache on as soon as the extension loads (OVERMIND_ENABLED=1).").tag(config=True)
    home = Unicode("", help="The daemon's state directory; default $XDG_RUNTIME_DIR/overmind or "
                             "~/.cache/overmind (OVERMIND_HOME).").tag(config=True)
    budget = Unicode("", help="Bytes the store may hold, e.g. '40G' or '50%' of RAM; read by the daemon "
                               "when it starts (OVERMIND_BUDGET).").tag(config=True)
    wait_timeout = Float(600.0, help="Seconds to wait for another kernel's load of the same model before "
                                     "loading plainly (OVERMIND_WAIT_TIMEOUT).").tag(config=True)
    arena = Enum(["auto", "memfd", "file"], "auto",
                 help="Backing of new cache entries: a file on disk (page cache), a memfd (shmem), or auto: "
                      "the file where OVERMIND_ARENA_DIR or the state directory is on a disk filesystem "
                      "(OVERMIND_ARENA).").tag(config=True)
    populate = Bool(True, help="Map a hit's pages ahead of the first forward, in the background "
                               "(OVERMIND_POPULATE=0 to turn off).").tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name, var in ENV.items():
            if var in os.environ:
                raw = os.environ[var]
                trait = self.traits()[name]
                value: Any = raw
                if isinstance(trait, Bool):
                    value = raw.strip().lower() not in ("", "0", "false", "no", "off")
                elif isinstance(trait, Float):
                    value = float(raw)
                setattr(self, name, value)

    def apply(self) -> None:
        """Hand the settings to the cached call and to the daemon this kernel may start."""
        from .loading import settings

        settings.wait_timeout = self.wait_timeout
        settings.backing = self.arena
        settings.populate = self.populate
        if self.home:
            os.environ["OVERMIND_HOME"] = self.home
        if self.budget:
            os.environ["OVERMIND_BUDGET"] = self.budget
