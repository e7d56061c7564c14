"""How settings arrive, apart from the settings themselves (:mod:`wan_s2v_runner.shared.spec`):
values from the environment (the fields' declared variables, a Slurm step's layout), a TOML file
(field or flag names), their layering (later wins; ``None`` never overrides), the doctor's
lenient view of partial values (:func:`draft`), how a default reads in help, and the one-line
error with its fix for a value the models refuse. The command line itself is
:mod:`wan_s2v_runner.launcher.flags` (argparse from the fields' :class:`~.spec.Flag` metadata).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional, Union

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from wan_s2v_runner.shared.spec import RunSpec, flag_name, flag_of

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


_PLACEHOLDERS: dict[str, Any] = {"ckpt_dir": Path("/nonexistent"), "image": Path("/nonexistent.png"),
                                 "audio": Path("/nonexistent.wav"), "prompt": "placeholder"}


@dataclass(frozen=True)
class SpecDraft:
    """What :meth:`RunSpec.draft` gives: the (possibly unvalidated) view and what it lacks."""

    spec: RunSpec  # validated when complete; else RunSpec.model_construct of the valid values
    complete: bool
    missing: list[str]
    error: Optional[ValidationError]


_ADAPTERS: dict[str, TypeAdapter] = {}


def field_adapter(name: str) -> TypeAdapter:
    """Validator of one spec field alone (type, constraints, path/area rules)."""
    if name not in _ADAPTERS:
        info: FieldInfo = RunSpec.model_fields[name]
        _ADAPTERS[name] = TypeAdapter(Annotated.__class_getitem__((info.annotation, *info.metadata)))
    return _ADAPTERS[name]


def draft(values: dict[str, Any]) -> "SpecDraft":
    """A lenient view of partial values, built from :class:`RunSpec` (no second list of fields).

    Each given value is validated on its own (its type, constraints and path rule); a value
    that fails keeps the field's default, a missing required field reads ``None``. The
    whole-spec rules are checked with placeholders for the missing inputs, so ``error``
    says why the given values could not make a valid spec even once the inputs are there.
    """
    given = {k: v for k, v in values.items() if v is not None}
    missing = [k for k in RunSpec.required_fields() if given.get(k) in (None, "")]
    if given.get("audio") in (None, "") and not given.get("tts_text"):
        missing.append("audio")  # the speech: --audio, or --tts-text
    fields: dict[str, Any] = {}
    for name, info in RunSpec.model_fields.items():
        if name in given:
            try:
                fields[name] = field_adapter(name).validate_python(given[name])
                continue
            except ValidationError:
                pass
        fields[name] = (None if info.is_required()
                        else field_adapter(name).validate_python(info.get_default(call_default_factory=True)))
    error: Optional[ValidationError] = None
    complete: Optional[RunSpec] = None
    placeholders = {k: _PLACEHOLDERS.get(k, "placeholder") for k in missing}
    try:
        full = RunSpec(**{**given, **placeholders})
        complete = None if missing else full
    except ValidationError as e:
        error = e
    return SpecDraft(spec=complete or RunSpec.model_construct(**fields), complete=complete is not None,
                     missing=missing, error=error)


def key_aliases() -> dict[str, str]:
    """Every accepted TOML/flag key spelling (dashes as underscores) -> field name."""
    out: dict[str, str] = {}
    for name in RunSpec.model_fields:
        for spelling in (flag_name(name), *flag_of(name).aliases):
            out[spelling.lstrip("-").replace("-", "_")] = name
        out[name] = name
    return out


def load_toml(path: Path) -> dict[str, Any]:
    """Read a run.toml (table ``[run]`` or top level). Keys are field names or flag names
    (``size``, ``sample_steps``, ``pg_timeout``...); '-' may be used for '_'."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    table = data.get("run", data)
    names = key_aliases()
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = k.replace("-", "_")
        out[names.get(key, key)] = v  # an unknown key stays and the spec rejects it by name
    return out


def env_values(env) -> dict[str, Any]:
    """Field values from the environment variables the fields declare (``Flag.env``), e.g. the
    PyTorchJob-style MASTER_ADDR/MASTER_PORT/WORLD_SIZE (= nodes)/RANK (= node), over the node
    layout of a Slurm ``srun`` step (:mod:`wan_s2v_runner.shared.slurm`). A value that does not
    validate for its field is ignored (other tools set these variables too)."""
    from wan_s2v_runner.shared.slurm import step_values

    out: dict[str, Any] = dict(step_values(env))
    for name in RunSpec.model_fields:
        var = flag_of(name).env
        raw = (env.get(var) or "").strip() if var else ""
        if raw:
            try:
                out[name] = field_adapter(name).validate_python(raw)
            except ValidationError:
                continue
    return out


def merge_values(*layers: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Later layers win; ``None`` means "not given" and never overrides."""
    out: dict[str, Any] = {}
    for layer in layers:
        out.update({k: v for k, v in (layer or {}).items() if v is not None})
    return out


def default_of(name: str) -> Union[str, Any]:
    """The default as a person reads it (README, help)."""
    f = flag_of(name)
    if f.default_text is not None:
        return f.default_text
    info = RunSpec.model_fields[name]
    if info.is_required():
        return "required"
    d = info.default
    if isinstance(d, Enum):
        return d.value
    if isinstance(d, bool):
        return "on" if d else "off"
    if d is None:
        return "none"
    if isinstance(d, float) and d.is_integer():
        return str(int(d))
    return str(d)


def format_validation_error(e: ValidationError) -> str:
    """One line per problem: the flag, the cause, and a fix."""
    lines = []
    for err in e.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        flag = flag_name(field) if field in RunSpec.model_fields else ("--" + field.replace("_", "-") if field else "")
        if field in RunSpec.model_fields and not flag_of(field).cli:  # no flag: what sets it
            flag = f"${flag_of(field).env}" if flag_of(field).env else f"{field} (--config)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            lines.append(f"error: {flag} is required. Fix: pass {flag} (or set {field} in --config).")
        elif err["type"] == "extra_forbidden":
            lines.append(f"error: unknown setting {field!r}. Fix: remove it from --config "
                         "(see the flags table in the README).")
        else:
            lines.append(f"error: {flag or 'spec'}: {msg}. Fix: correct {flag or 'the flags'}.")
    return "\n".join(lines)
