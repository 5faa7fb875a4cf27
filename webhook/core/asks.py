"""Reading what each container of a pod spec asks for, in any of the forms users write."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from webhook.core import findings as f
from webhook.core import quantities
from webhook.core.policy import Policy

MIB = 1 << 20

INIT = "init"
SIDECAR = "sidecar"
APP = "app"

# Where each container list lives in a pod spec, and its group.
CONTAINER_LISTS = (("initContainers", INIT), ("containers", APP))


@dataclass(slots=True)
class ContainerAsk:
    """One container's GPU ask, read and checked."""

    name: str
    group: str  # INIT, SIDECAR or APP
    list_key: str  # "initContainers" or "containers"
    position: int
    shares: int = 0  # shares of one card; 0 = none
    pin: int | None = None  # an explicit gpushard.io/card-<k>
    passthrough: bool = False  # a whole-card ask gpushard leaves to another device plugin
    fraction: Fraction | None = None  # the nvidia.com/gpu value, when the container wrote one
    fraction_text: str = ""
    # A memory ask (gpushard.io/memory), in whole MiB rounded up: its shares depend on the card
    # size placement picks, so ``shares`` stays 0 until then (see ``size``).
    memory_mib: int | None = None
    memory_text: str = ""
    findings: list[f.Finding] = field(default_factory=list)

    @property
    def holds_share(self) -> bool:
        return (self.shares > 0 or self.memory_mib is not None) and not self.passthrough

    @property
    def denied(self) -> bool:
        return any(x.severity == f.DENY for x in self.findings)


def _mapping(value: object, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise f.ObjectError(where, f"expected a mapping, got {type(value).__name__}")
    return value


def containers(spec: dict) -> list[tuple[str, int, dict]]:
    """(list key, position, container) for init and app containers, checked for shape."""
    found = []
    for key, _group in CONTAINER_LISTS:
        items = spec.get(key)
        if items is None:
            continue
        if not isinstance(items, list):
            raise f.ObjectError(f"spec.{key}", f"expected a list, got {type(items).__name__}")
        for i, container in enumerate(items):
            if not isinstance(container, dict):
                raise f.ObjectError(f"spec.{key}[{i}]", f"expected a mapping, got {type(container).__name__}")
            found.append((key, i, container))
    return found


QUOTE_MAX = 40


def _text(value: object) -> str:
    """A value as the user wrote it, cut short enough to quote in a message."""
    text = value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
    return text if len(text) <= QUOTE_MAX else text[: QUOTE_MAX - 3] + "..."


def _where(name: str) -> str:
    """How a message names the container (built only when there is something to say)."""
    return f'container "{_text(name)}"'


def _example(resource: str, res) -> str:
    """An example of a good value, for a message about a bad one."""
    return "12Gi or 20480Mi" if resource == res.memory else "0.25, 250m or 1"


def _deny(ask: ContainerAsk, rule: str, message: str) -> None:
    ask.findings.append(f.Finding(rule, f.DENY, f"gpushard: {_where(ask.name)} {message}", ask.name))


_ABSENT = (None, "")


def _one_value(ask: ContainerAsk, limits: dict, requests: dict, resource: str, res) -> tuple[Fraction | None, str]:
    """The resource's value, requiring requests == limits; (None, "") when absent or bad."""
    lim, req = limits.get(resource), requests.get(resource)
    if lim is None and req is None:
        return None, ""
    if type(lim) is str and lim == req:
        # The usual ask, the same text in both: read once (an error is said for limits first).
        try:
            value = quantities.parse(lim)
        except quantities.QuantityError:
            _deny(ask, f.BAD_QUANTITY, f"asks {resource} {_text(lim)!r} in limits; that is not a quantity "
                  f"(write e.g. {_example(resource, res)})")
            return None, ""
        text = _text(lim)
        if value.numerator < 0:  # a Fraction's sign is its numerator's
            _deny(ask, f.BAD_QUANTITY, f"asks {resource} {text!r}; a GPU ask cannot be negative")
            return None, ""
        return value, text
    values = {}
    for label, raw in (("limits", lim), ("requests", req)):
        if raw is None:
            continue
        try:
            values[label] = (quantities.parse(raw), _text(raw))
        except quantities.QuantityError:
            _deny(ask, f.BAD_QUANTITY, f"asks {resource} {_text(raw)!r} in {label}; that is not a quantity "
                  f"(write e.g. {_example(resource, res)})")
            return None, ""
    if len(values) == 2 and values["limits"][0] != values["requests"][0]:
        _deny(ask, f.REQUESTS_DIFFER, f"asks {resource} {values['requests'][1]} in requests but "
              f"{values['limits'][1]} in limits; set both to the same value")
        return None, ""
    value, text = values.get("limits") or values["requests"]
    if value < 0:
        _deny(ask, f.BAD_QUANTITY, f"asks {resource} {text!r}; a GPU ask cannot be negative")
        return None, ""
    return value, text


def read(list_key: str, position: int, container: dict, policy: Policy) -> ContainerAsk:
    """Read and check one container's ask."""
    res = policy.resources
    name = container.get("name")
    if not (isinstance(name, str) and name):
        name = f"{list_key}[{position}]"
    group = APP
    if list_key == "initContainers":
        group = SIDECAR if container.get("restartPolicy") == "Always" else INIT
    ask = ContainerAsk(name, group, list_key, position)
    resources = container.get("resources")
    if resources is None:
        return ask
    if type(resources) is not dict:
        resources = _mapping(resources, f"spec.{list_key}[{position}].resources")
    limits, requests = resources.get("limits"), resources.get("requests")
    if type(limits) is not dict:
        limits = _mapping(limits, f"spec.{list_key}[{position}].resources.limits")
    if type(requests) is not dict:
        requests = _mapping(requests, f"spec.{list_key}[{position}].resources.requests")
    # Most containers (sidecars, init steps) name no GPU resource at all: nothing below could
    # find anything in them, so they are read with one look at each resource name, which also
    # collects the names with the card prefix (only those can be a card or a bad card).
    ours, prefix = res.gpu_names, res.card_prefix
    gpu, card_keys = False, None
    for part in (limits, requests):
        for key in part:
            if key in ours:
                gpu = True
            if type(key) is str and key.startswith(prefix):
                if card_keys is None:
                    card_keys = [key]
                else:
                    card_keys.append(key)
    if not gpu and card_keys is None:
        return ask
    return _read_gpu(ask, limits, requests, card_keys or [], policy)


def _read_gpu(ask: ContainerAsk, limits: dict, requests: dict, card_keys: list[str], policy: Policy) -> ContainerAsk:
    """The rest of ``read``, for a container that names one of gpushard's resources."""
    res = policy.resources
    fraction, fraction_text = _one_value(ask, limits, requests, res.fraction, res)
    # Most asks name one form: the others are absent, and looked for without a call.
    resource = res.shares
    shares_q, shares_text = _one_value(ask, limits, requests, resource, res) if (
        resource in limits or resource in requests) else _ABSENT
    resource = res.memory
    memory, memory_text = _one_value(ask, limits, requests, resource, res) if (
        resource in limits or resource in requests) else _ABSENT
    # Sorting just the card names keeps the order of the findings, since every one of them is
    # text. Most asks name no card at all.
    if len(card_keys) > 1:
        card_keys = sorted(set(card_keys))
    for key in card_keys:
        if res.card_index(key) is None:
            _deny(ask, f.BAD_CARD, f"names {_text(key)!r}, which is no card resource (cards are "
                  f"{res.card_prefix}0, {res.card_prefix}1, ...)")
    if ask.findings:  # only denials so far
        return ask
    pins = sorted(i for i in map(res.card_index, card_keys) if i is not None) if card_keys else []
    pin_values = {}
    for k in pins:
        value, text = _one_value(ask, limits, requests, res.card(k), res)
        if value is not None:
            pin_values[k] = (value, text)
    if ask.findings:  # only denials so far
        return ask

    if len(pins) > 1:
        _deny(ask, f.CONFLICTING_PINS, f"names cards {', '.join(map(str, pins))}; a pod may use one card")
        return ask
    if fraction is not None and shares_q is not None:
        _deny(ask, f.BOTH_FORMS, f"asks both {res.fraction} {fraction_text} and {res.shares} {shares_text}; use one")
        return ask
    if memory is not None and memory.numerator != 0:
        other = (f"{res.fraction} {fraction_text}" if fraction is not None else
                 f"{res.shares} {shares_text}" if shares_q is not None else
                 res.card(pins[0]) if pins else None)
        if other is not None:
            _deny(ask, f.MIXED_MEMORY, f"asks both {res.memory} {memory_text} and {other}; ask GPU memory or a "
                  "share of a card, not both")
            return ask
        ask.memory_mib = -(-memory.numerator // (memory.denominator * MIB))  # whole MiB, rounded up
        ask.memory_text = memory_text
        return ask

    spc = policy.shares_per_card
    name = ask.name
    # In integers, read with one call (a Fraction's numerator and denominator are each a property
    # call, and its comparisons cost more still).
    numerator, denominator = fraction.as_integer_ratio() if fraction is not None else (0, 1)
    if numerator != 0:
        assert fraction is not None  # a numerator of 0 stands for no fraction
        ask.fraction, ask.fraction_text = fraction, fraction_text
        if numerator < denominator:  # below 1
            ask.shares, rounded = quantities.shares_of(numerator, denominator, spc)
            if rounded:
                ask.findings.append(f.Finding(
                    f.ROUNDED, f.WARN,
                    f"gpushard: {_where(name)} asks {res.fraction} {fraction_text}; rounded up to {ask.shares} "
                    f"of {spc} shares", name))
        elif fraction == 1:
            if policy.whole_cards == "passthrough":
                ask.passthrough = True
            ask.shares = spc
        elif not quantities.is_integer(fraction):
            _deny(ask, f.FRACTION_ABOVE_ONE, f"asks {res.fraction} {fraction_text}; a pod may use at most one card "
                  f"(ask 1, or a fraction below 1)")
        elif policy.multi_card == "passthrough":
            ask.passthrough = True
            ask.shares = int(fraction) * spc
        else:
            _deny(ask, f.MULTI_CARD, f"asks {res.fraction} {fraction_text}; a pod may use at most one card "
                  f"(ask 1, or a fraction below 1)")
    elif shares_q is not None and shares_q != 0:
        if not quantities.is_integer(shares_q) or not 1 <= shares_q <= spc:
            _deny(ask, f.BAD_SHARES, f"asks {res.shares} {shares_text}; shares must be a whole number from 1 to {spc}")
        else:
            ask.shares = int(shares_q)

    if pins and not ask.denied:
        k = pins[0]
        if k in pin_values:
            value, text = pin_values[k]
            if ask.shares == 0 and not ask.passthrough:
                if not quantities.is_integer(value) or not 1 <= value <= spc:
                    _deny(ask, f.BAD_SHARES, f"asks {res.card(k)} {text}; shares must be a whole number from 1 "
                          f"to {spc}")
                    return ask
                ask.shares = int(value)
            elif ask.passthrough:
                _deny(ask, f.MIXED_PASSTHROUGH, f"asks {res.fraction} {ask.fraction_text} passed through as whole "
                      f"cards but also pins {res.card(k)}")
                return ask
            elif value != ask.shares:
                _deny(ask, f.PIN_MISMATCH, f"asks {ask.shares} shares but {res.card(k)} {text}; they must match")
                return ask
            ask.pin = k
    return ask


def size(asks: list[ContainerAsk], card_mib: int, shares_per_card: int) -> int:
    """Give each memory ask its shares of a card of ``card_mib`` MiB; the pod's shares after that.

    ceil(ask x sharesPerCard / card memory): those shares' memory (shares x card / sharesPerCard,
    what isolation caps the container at) is never below the ask.
    """
    for a in asks:
        if a.memory_mib is not None:
            a.shares = -(-a.memory_mib * shares_per_card // card_mib)
    return effective_shares(asks)


def asks_memory(asks: list[ContainerAsk]) -> bool:
    """Whether any container asks GPU memory (a loop: cheaper than any() over a generator)."""
    for a in asks:
        if a.memory_mib is not None:
            return True
    return False


def memory_mib(asks: list[ContainerAsk]) -> int:
    """The pod's memory ask in MiB, counted as Kubernetes counts a pod's requests (as ``effective_shares``)."""
    return effective_shares([ContainerAsk(a.name, a.group, a.list_key, a.position, shares=a.memory_mib)
                             for a in asks if a.memory_mib is not None])


def read_spec(spec: dict, policy: Policy) -> list[ContainerAsk]:
    """Every init, sidecar and app container's ask, in spec order."""
    return [read(key, i, c, policy) for key, i, c in containers(spec)]


def effective_shares(asks: list[ContainerAsk]) -> int:
    """The pod's shares as Kubernetes counts a pod's requests.

    Each regular init container runs alongside the sidecars started before it; app
    containers run alongside every sidecar. The pod needs the largest of those moments.
    """
    return held_shares([a for a in asks if a.holds_share])


def held_shares(held: list[ContainerAsk]) -> int:
    """``effective_shares`` of the asks that hold a share (``held``, in spec order)."""
    total = 0
    for a in held:  # the usual pod: its app containers run side by side
        if a.group != APP:
            break
        total += a.shares
    else:
        return total
    sidecars_so_far = 0
    peak_init = 0
    for a in held:
        if a.list_key == "initContainers":
            if a.group == SIDECAR:
                sidecars_so_far += a.shares
            else:
                peak_init = max(peak_init, a.shares + sidecars_so_far)
    steady = sidecars_so_far + sum(a.shares for a in held if a.group == APP)
    return max(peak_init, steady)
