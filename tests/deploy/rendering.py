"""A small Kustomize for the tests: renders deploy/ without the kustomize binary, which is not installed here.

It knows what gpushard's kustomizations use and refuses anything else, so a new feature
in a kustomization.yaml fails loudly instead of being rendered wrongly: resources (files
and folders), patches (strategic merge, including `$patch: delete`, and JSON 6902 with a
target), images, labels without selectors, ConfigMap generators from files without a
name hash, and replacements from one field into another (the whole value, or one part of it
between delimiters), run last as kustomize runs them. Objects annotated
`config.kubernetes.io/local-config: "true"` stay visible to every kustomization above them (their
patches and replacements) and are left out of the final output, as kustomize leaves them out.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonpatch
import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "patches", "images", "labels", "configMapGenerator",
                "replacements"}
LOCAL_CONFIG = "config.kubernetes.io/local-config"
# Lists that strategic merge joins by a key instead of replacing (the ones our patches touch).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "webhooks": "name", "ports": "containerPort"}


class KustomizeError(ValueError):
    """A kustomization this renderer does not understand, or one that kustomize would refuse."""


def load_documents(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc:
            raise KustomizeError(f"{path}: a document without a kind")
    return docs


def kustomization(folder: Path) -> dict:
    data = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(data) - KNOWN_FIELDS
    if unknown:
        raise KustomizeError(f"{folder}/kustomization.yaml: fields this renderer does not know: {sorted(unknown)}")
    return data


def listed_files(folder: Path) -> set[Path]:
    """Every file a kustomization (and the kustomizations it includes) reads."""
    folder = folder.resolve()
    data = kustomization(folder)
    files = {folder / "kustomization.yaml"}
    for entry in data.get("resources", []):
        path = (folder / entry).resolve()
        files |= listed_files(path) if path.is_dir() else {path}
    for patch in data.get("patches", []):
        if "path" in patch:
            files.add((folder / patch["path"]).resolve())
    for generator in data.get("configMapGenerator", []):
        files |= {(folder / entry.partition("=")[2]).resolve() for entry in generator.get("files", [])}
    return files


def _generated_config_maps(folder: Path, generators: list[dict]) -> list[dict]:
    out = []
    for generator in generators:
        unknown = set(generator) - {"name", "namespace", "files", "options"}
        options = generator.get("options") or {}
        if unknown or set(options) - {"disableNameSuffixHash", "labels"} or not options.get("disableNameSuffixHash"):
            raise KustomizeError(f"{folder}: configMapGenerator {generator.get('name')}: only files, a namespace "
                                 "and labels, without a name hash, are rendered here")
        data = {}
        for entry in generator["files"]:
            key, _, path = entry.partition("=")
            if not path:
                raise KustomizeError(f"{folder}: configMapGenerator files need key=path, got {entry!r}")
            data[key] = (folder / path).read_text()
        meta = {"name": generator["name"], **({"namespace": generator["namespace"]} if "namespace" in generator
                                              else {}), **({"labels": dict(options["labels"])} if "labels" in options
                                                           else {})}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    return out


def _id(obj: dict) -> tuple[str, str, str, str]:
    meta = obj.get("metadata") or {}
    group = obj.get("apiVersion", "").rpartition("/")[0]
    return group, obj["kind"], meta.get("namespace", ""), meta["name"]


def _strategic_merge(target, patch):
    if isinstance(patch, dict) and isinstance(target, dict):
        out = copy.deepcopy(target)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = _merge_field(key, out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    return copy.deepcopy(patch)


def _merge_field(key: str, old, new):
    merge_key = MERGE_KEYS.get(key)
    if merge_key and isinstance(old, list) and isinstance(new, list):
        out = copy.deepcopy(old)
        for item in new:
            match = [i for i, o in enumerate(out) if o.get(merge_key) == item.get(merge_key)]
            if item.get("$patch") == "delete":
                out = [o for o in out if o.get(merge_key) != item.get(merge_key)]
            elif match:
                out[match[0]] = _strategic_merge(out[match[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return _strategic_merge(old, new)


def _selected(obj: dict, target: dict) -> bool:
    group, kind, namespace, name = _id(obj)
    version = obj.get("apiVersion", "").rpartition("/")[2]
    checks = {"group": group, "version": version, "kind": kind, "name": name, "namespace": namespace}
    unknown = set(target) - set(checks)
    if unknown:
        raise KustomizeError(f"patch target fields this renderer does not know: {sorted(unknown)}")
    return all(checks[k] == v for k, v in target.items())


def _apply_patch(objects: list[dict], entry: dict, folder: Path) -> list[dict]:
    text = (folder / entry["path"]).read_text() if "path" in entry else entry["patch"]
    patch = yaml.safe_load(text)
    if isinstance(patch, list):
        if "target" not in entry:
            raise KustomizeError(f"{folder}: a JSON 6902 patch needs a target")
        hits = [o for o in objects if _selected(o, entry["target"])]
        if not hits:
            raise KustomizeError(f"{folder}: patch target {entry['target']} matches nothing")
        return [jsonpatch.apply_patch(o, patch) if o in hits else o for o in objects]
    wanted = _id(patch)
    hits = [o for o in objects if _id(o) == wanted]
    if len(hits) != 1:
        raise KustomizeError(f"{folder}: strategic merge patch for {wanted} matches {len(hits)} objects")
    if patch.get("$patch") == "delete":
        return [o for o in objects if _id(o) != wanted]
    return [_strategic_merge(o, patch) if _id(o) == wanted else o for o in objects]


def pod_specs(obj: dict) -> list[dict]:
    """The pod specs inside an object (a Pod, a workload's template, a CronJob's job template)."""
    spec = obj.get("spec") or {}
    if obj["kind"] == "Pod":
        return [spec]
    if obj["kind"] == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]["spec"]]
    if "template" in spec:
        return [spec["template"]["spec"]]
    return []


def pod_template_labels(obj: dict) -> dict:
    """The labels of the pods a workload makes."""
    spec = obj.get("spec") or {}
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}


def _set_images(objects: list[dict], images: list[dict]) -> None:
    for obj in objects:
        for spec in pod_specs(obj):
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                name, _, tag = container["image"].partition(":")
                for image in images:
                    if image["name"] != name:
                        continue
                    new = image.get("newName", name)
                    tag = image.get("newTag", tag)
                    container["image"] = f"{new}:{tag}" if tag else new
                    if image.get("digest"):
                        container["image"] = f"{new}@{image['digest']}"


def _is_local(obj: dict) -> bool:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(LOCAL_CONFIG) == "true"


def _path_steps(field_path: str) -> list[str]:
    """kustomize's field path: dot-separated, a list item picked as `[key=value]` (dots inside kept)."""
    steps, at = [], 0
    while at < len(field_path):
        if field_path[at] == "[":
            end = field_path.index("]", at)
            steps.append(field_path[at:end + 1])
            at = end + 1
        else:
            end = field_path.find(".", at)
            end = len(field_path) if end < 0 else end
            steps.append(field_path[at:end])
            at = end
        if at < len(field_path):
            if field_path[at] != ".":
                raise KustomizeError(f"field path {field_path!r}: expected '.' at {at}")
            at += 1
    return steps


def _walk(obj: dict, field_path: str, what: str) -> tuple[object, object]:
    """The container holding the field at ``field_path``, and the key (or index) of the field in it."""
    steps = _path_steps(field_path)
    holder: object = obj
    for i, step in enumerate(steps):
        if step.startswith("["):
            key, _, value = step[1:-1].partition("=")
            if not isinstance(holder, list):
                raise KustomizeError(f"{what}: {field_path!r}: {step} needs a list")
            hits = [j for j, item in enumerate(holder) if isinstance(item, dict) and str(item.get(key)) == value]
            if len(hits) != 1:
                raise KustomizeError(f"{what}: {field_path!r}: {step} matches {len(hits)} items")
            key_or_index: object = hits[0]
        else:
            if not isinstance(holder, dict) or step not in holder:
                raise KustomizeError(f"{what}: fieldPath {field_path!r} is missing")
            key_or_index = step
        if i == len(steps) - 1:
            return holder, key_or_index
        holder = holder[key_or_index]  # type: ignore[index]
    raise KustomizeError(f"{what}: an empty field path")


def _matching(objects: list[dict], select: dict, what: str) -> list[dict]:
    unknown = set(select) - {"group", "version", "kind", "name", "namespace"}
    if unknown:
        raise KustomizeError(f"{what}: selector fields this renderer does not know: {sorted(unknown)}")
    return [o for o in objects if _selected(o, select)]


def _replace(objects: list[dict], replacement: dict, folder: Path) -> None:
    """One entry of `replacements`: the source field's value into each target field, in place."""
    what = f"{folder}: replacement"
    if set(replacement) - {"source", "targets"}:
        raise KustomizeError(f"{what}: only source and targets are rendered here (no path)")
    source = dict(replacement["source"])
    field_path = source.pop("fieldPath", "metadata.name")
    found = _matching(objects, source, what)
    if len(found) != 1:
        raise KustomizeError(f"{what}: source {replacement['source']} matches {len(found)} objects")
    holder, key = _walk(found[0], field_path, what)
    value = holder[key]  # type: ignore[index]
    for target in replacement["targets"]:
        if set(target) - {"select", "fieldPaths", "options"}:
            raise KustomizeError(f"{what}: target fields this renderer does not know: {sorted(target)}")
        options = target.get("options") or {}
        if set(options) - {"delimiter", "index"}:
            raise KustomizeError(f"{what}: options this renderer does not know: {sorted(options)}")
        hits = _matching(objects, target["select"], what)
        if not hits:
            raise KustomizeError(f"{what}: target {target['select']} matches nothing")
        for obj in hits:
            for path in target["fieldPaths"]:
                into, at = _walk(obj, path, what)
                if "delimiter" in options:
                    # The target's value split at the delimiter, part `index` replaced, joined again.
                    parts = str(into[at]).split(options["delimiter"])  # type: ignore[index]
                    index = int(options.get("index", 0))
                    if not 0 <= index < len(parts):
                        raise KustomizeError(f"{what}: {path!r} has no part {index} between "
                                             f"{options['delimiter']!r}")
                    parts[index] = str(value)
                    into[at] = options["delimiter"].join(parts)  # type: ignore[index]
                else:
                    into[at] = copy.deepcopy(value)  # type: ignore[index]


def _render(folder: Path) -> list[dict]:
    folder = folder.resolve()
    data = kustomization(folder)
    objects: list[dict] = []
    for entry in data.get("resources", []):
        path = folder / entry
        objects += _render(path) if path.is_dir() else load_documents(path)
    objects += _generated_config_maps(folder, data.get("configMapGenerator", []))
    ids = [_id(o) for o in objects]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise KustomizeError(f"{folder}: objects defined twice: {sorted(duplicates)}")
    for entry in data.get("patches", []):
        objects = _apply_patch(objects, entry, folder)
    _set_images(objects, data.get("images", []))
    for entry in data.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise KustomizeError(f"{folder}: labels with selectors or templates are not rendered here")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    for replacement in data.get("replacements", []):
        _replace(objects, replacement, folder)
    return objects


def render(folder: Path) -> list[dict]:
    """The objects `kubectl kustomize folder` would print (in file order, not kind order)."""
    return [o for o in _render(folder) if not _is_local(o)]
