"""Whether the node's NVIDIA container toolkit keeps a shared node's promise, read from its config file.

Outside enforce namespaces nothing is rewritten (docs/concepts.md): a pod there that
writes ``NVIDIA_VISIBLE_DEVICES=all`` (or runs an image that does, as CUDA images do) is stopped from seeing
the node's cards only by the toolkit, when ``accept-nvidia-visible-devices-envvar-when-unprivileged`` is
false. Its default is true (nvidia-container-toolkit ``api/config/v1/config.go``, ``GetDefault``), and with it
such a pod sees every card of the node: make e2e's runtime tier shows both on NVIDIA's real runtime
(tests/runtime/test_nvidia.py). ``accept-nvidia-visible-devices-as-volume-mounts`` (default false) is what
lets the agent's device-list mounts name the card on such a hardened node.

The toolkit reads one file: ``$NVIDIA_CTK_CONFIG_FILE_PATH``, else ``$XDG_CONFIG_HOME`` or /etc, then
``nvidia-container-runtime/config.toml``. A hand install keeps it in /etc; the GPU Operator's toolkit
(``nvidia-ctk-installer``) writes it under its toolkit root, /usr/local/nvidia/toolkit/.config. The agent
reads the first of its candidates that exists; no file at all means the toolkit's defaults, if the toolkit
is there, which the agent cannot tell from here: it says so and judges nothing.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, as a package (setup.cfg's agent extra)
    import tomli as tomllib

log = logging.getLogger(__name__)

# The GPU Operator's file first: where both exist, the operator's runtime is the one containerd was set up with.
CONFIG_PATHS = ("/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml",
                "/etc/nvidia-container-runtime/config.toml")
ENVVAR_KEY = "accept-nvidia-visible-devices-envvar-when-unprivileged"
MOUNTS_KEY = "accept-nvidia-visible-devices-as-volume-mounts"
DEFAULTS = {ENVVAR_KEY: True, MOUNTS_KEY: False}
FIX = (f"set {ENVVAR_KEY} = false and {MOUNTS_KEY} = true in the toolkit's config.toml (with the GPU Operator: "
       "toolkit.env ACCEPT_NVIDIA_VISIBLE_DEVICES_ENVVAR_WHEN_UNPRIVILEGED=false and "
       "ACCEPT_NVIDIA_VISIBLE_DEVICES_AS_VOLUME_MOUNTS=true), then restart containerd (docs/install.md, "
       "\"Prerequisites\")")


@dataclass(frozen=True)
class Verdict:
    """What the toolkit's config says; ``path`` None: no file found, nothing judged."""

    path: str | None = None
    accept_envvar_unprivileged: bool | None = None
    accept_volume_mounts: bool | None = None
    error: str = ""
    envvar_key_set: bool = False  # the file sets the key itself (else the toolkit's default applies)

    @property
    def hardened(self) -> bool | None:
        """False: an unprivileged container's NVIDIA_VISIBLE_DEVICES picks cards; None: not known."""
        return None if self.accept_envvar_unprivileged is None else not self.accept_envvar_unprivileged

    def as_json(self) -> dict:
        """What each card's inventory entry says (names.INVENTORY_TOOLKIT), camelCase as Kubernetes users expect."""
        found = {"config": self.path, "hardened": self.hardened,
                 "acceptEnvvarWhenUnprivileged": self.accept_envvar_unprivileged,
                 "acceptVolumeMounts": self.accept_volume_mounts}
        if self.error:
            found["error"] = self.error
        return found

    def message(self, candidates: Sequence[str] = CONFIG_PATHS) -> str:
        if self.error:
            return f"gpushard: cannot read NVIDIA's container toolkit config {self.path}: {self.error}"
        if self.path is None:
            return (f"gpushard: no NVIDIA container toolkit config on this node ({', '.join(candidates)}): if the "
                    f"node runs NVIDIA's runtime it runs with the defaults, where {ENVVAR_KEY} is true")
        if self.hardened:
            return (f"gpushard: NVIDIA's container toolkit ignores NVIDIA_VISIBLE_DEVICES in unprivileged "
                    f"containers ({self.path}: {ENVVAR_KEY} = false; {MOUNTS_KEY} = "
                    f"{str(self.accept_volume_mounts).lower()})")
        said = "= true" if self.envvar_key_set else "not set, the toolkit's default: true"
        return (f"gpushard: NVIDIA's container toolkit on this node accepts NVIDIA_VISIBLE_DEVICES from unprivileged "
                f"containers ({self.path}: {ENVVAR_KEY} {said}): a pod outside gpushard's enforce namespaces that "
                f"writes NVIDIA_VISIBLE_DEVICES=all, or runs a CUDA image, sees every card of this node; {FIX}")


def parse(text: str, path: str) -> Verdict:
    """The verdict of one config file's text: the two top-level keys, the toolkit's defaults where unset."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return Verdict(path, error=f"not TOML: {exc}")
    values = {}
    for key in (ENVVAR_KEY, MOUNTS_KEY):
        value = data.get(key, DEFAULTS[key])
        if not isinstance(value, bool):
            return Verdict(path, error=f"{key} is {value!r}, not true or false")
        values[key] = value
    return Verdict(path, values[ENVVAR_KEY], values[MOUNTS_KEY], envvar_key_set=ENVVAR_KEY in data)


def read(candidates: Sequence[str] = CONFIG_PATHS) -> Verdict:
    """The first candidate that exists, judged; Verdict() when none does."""
    for candidate in candidates:
        path = Path(candidate)
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        except OSError as exc:
            return Verdict(candidate, error=exc.strerror or str(exc))
        except UnicodeDecodeError:
            return Verdict(candidate, error="not UTF-8 text")
        return parse(text, candidate)
    return Verdict()


class Checker:
    """Reads the toolkit's config when asked; logs each new verdict once (WARNING while the promise is broken)."""

    def __init__(self, candidates: Sequence[str] = CONFIG_PATHS) -> None:
        self.candidates = tuple(candidates)
        self.verdict: Verdict | None = None

    def check(self) -> Verdict:
        verdict = read(self.candidates)
        if verdict != self.verdict:
            level = logging.WARNING if verdict.hardened is False or verdict.error else logging.INFO
            log.log(level, "%s", verdict.message(self.candidates))
        self.verdict = verdict
        return verdict
