"""Hydra's own rejections of a command line (an unknown key or option, a value of the wrong
type, bad override syntax) told the way ftbench tells every bad setting: one paragraph naming
the setting and the fix, exit code 2, and a run folder whose summary.json says so."""
from __future__ import annotations

import difflib
import json
import re
import sys
import textwrap
import time
from pathlib import Path

from ftbench.errors import ConfigError

EXIT_SETTING = 2


def _messages(err: BaseException) -> str:
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        parts.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(parts)


def _setting(text: str, overrides: list[str]) -> str:
    for pattern in (r"full_key: ([\w.\[\]]+)", r"Could not override '([^']+)'", r"Could not append to config\. "
                    r"An item is already at '([^']+)'", r"Could not find '([^'/]+)/"):
        match = re.search(pattern, text)
        if match:
            return match.group(1)
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    return next((k for k in keys if k and k in text), keys[0] if keys else "the command line")


_TYPES = {"Integer": "an integer (e.g. 2)", "Float": "a number (e.g. 0.5)", "valid bool": "true or false"}


def _strategies_with(setting: str, conf_dir: Path) -> list[str]:
    """The strategy options (conf/strategy/*.yaml) whose schema has the field `strategy.X`."""
    if not setting.startswith("strategy."):
        return []
    import dataclasses

    from ftbench.config import strategy_schemas

    field = setting.split(".", 1)[1]
    schemas = strategy_schemas()
    owners = []
    for path in sorted((conf_dir / "strategy").glob("*.yaml")):
        schema = re.search(r"/schema/strategy/([\w-]+)@", path.read_text(encoding="utf-8"))
        node = schemas.get(schema.group(1)) if schema else None
        if node is not None and field in {f.name for f in dataclasses.fields(node)}:
            owners.append(path.stem)
    owners += [name for name, node in schemas.items()  # other packages' strategies have no YAML file here
               if not (conf_dir / "strategy" / f"{name}.yaml").exists() and field in {f.name for f in dataclasses.fields(node)}]
    return owners


def _expanded_braces(overrides: list[str]) -> str | None:
    """A key given twice with `[k:v]` values: the shell's brace expansion split an unquoted
    `key=[{a:1,b:2}]` into `key=[a:1]` and `key=[b:2]`."""
    seen: dict[str, int] = {}
    for override in overrides:
        key, _, value = override.partition("=")
        if re.fullmatch(r"\[[\w.]+:[^,{}\[\]]*\]", value.strip()):
            seen[key] = seen.get(key, 0) + 1
    return next((key for key, n in seen.items() if n > 1), None)


def _fix(setting: str, text: str, conf_dir: Path) -> str:
    if "Ambiguous value for argument" in text:  # a comma list is a sweep: Hydra's own hint, kept
        given = re.search(r"Ambiguous value for argument '([^']+)'", text)
        sweep = given.group(1) if given else f"{setting}=a,b"
        return f"a comma-separated list sweeps several values: add --multirun (`ftbench --multirun {sweep}`), or give one value"
    for word, kind in _TYPES.items():
        if f"converted to {word}" in text or f"is not a {word}" in text:
            value = re.search(r"Value '([^']*)'", text)
            return f"{setting} takes {kind}" + (f", not '{value.group(1)}'" if value else "")
    folder = conf_dir / setting
    if folder.is_dir():  # an unknown option of a config group
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        return f"choose one of {', '.join(options)}"
    if "To append to your config use" in text or "not in" in text or "Could not override" in text:
        from ftbench.context import schema_keys

        owners = _strategies_with(setting, conf_dir)
        if owners:  # a field of another strategy than the one chosen
            which = f"strategy={owners[0]}" if len(owners) == 1 else f"the strategies {', '.join(owners)}"
            return f"{setting} is a setting of {which} only: choose {'it' if len(owners) == 1 else 'one'}, or drop it"
        close = [k for k in difflib.get_close_matches(setting, schema_keys(), n=4, cutoff=0.6) if k != setting][:3]
        return (f"did you mean {' or '.join(close)}? " if close else "") + "see `ftbench --help` for the settings"
    return "check the value's type and syntax (`ftbench --help` lists the settings)"


def _new_folder(stem: Path) -> Path:
    """`stem`, or `stem-2`, `stem-3`, ... : a folder of its own, so that two config errors in
    the same second do not share (and overwrite) one."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    for k in range(1, 10_000):
        folder = stem if k == 1 else stem.with_name(f"{stem.name}-{k}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise OSError(f"no free folder name beside {stem}")


def _given_run_dir(overrides: list[str]) -> Path | None:
    """The run folder a rejected command line names (`hydra.run.dir=...`, the last one wins),
    read as text: Hydra could not compose it, and the folder is still the user's choice."""
    given = None
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+~") == "hydra.run.dir" and value.strip("'\""):
            given = Path(value.strip("'\""))
    return given


def _own_error(err: BaseException) -> ConfigError | None:
    """Our own ConfigError, raised as is or from a resolver (OmegaConf wraps what resolvers raise)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, ConfigError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _parsed(override: str):
    """Hydra's reading of one override, or None where its grammar rejects it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(override)
    except Exception:  # noqa: BLE001 - the grammar's errors come in several kinds
        return None


def _unparsable(overrides: list[str]) -> ConfigError | None:
    """The override Hydra's grammar rejects, named by its key (the whole command line's parse
    error names no override, so the first key that happened to appear in it was blamed)."""
    for override in overrides:
        if _parsed(override) is not None:
            continue
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        counts = [(o, c, value.count(o), value.count(c)) for o, c in (("[", "]"), ("{", "}"), ("(", ")"))]
        unbalanced = [f"{n} '{o}' but {m} '{c}'" for o, c, n, m in counts if n != m]
        problem = (f"its brackets do not balance ({', '.join(unbalanced)})" if unbalanced
                   else f"'{value}' is not a value Hydra can read")
        example = "[{iteration:3,node:1}]" if key == "failures.events" else "..."
        return ConfigError(key, problem, f"close every bracket and brace, and put the whole override in single "
                           f"quotes so that the shell passes it as it is: '{key}={example}'")
    return None


def _list_item(setting: str, text: str, overrides: list[str]) -> str:
    """`failures.events[1].at` where OmegaConf names only `at`: a field of an item of a list
    given on the command line. The item is the first with that field (and the rejected value)."""
    target = re.search(r"Error merging override ([\w.]+)=|Could not override '([\w.]+)'", text)
    if "." in setting or "[" in setting or target is None:
        return setting
    key = target.group(1) or target.group(2)
    value = re.search(r"Value '([^']*)'", text)
    for override in overrides:
        parsed = _parsed(override) if override.partition("=")[0].lstrip("+~") == key else None
        items = parsed.value() if parsed is not None else None
        for i, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, dict) and setting in item and (value is None or str(item[setting]) == value.group(1)):
                return f"{key}[{i}].{setting}"
    return setting


def _item_keys(setting: str, text: str) -> str | None:
    """For an unknown field of a list item: the fields its schema has (e.g. FailureEventConfig's)."""
    import dataclasses

    from ftbench import config

    schema = re.search(r"not in '(\w+)'", text)
    node = getattr(config, schema.group(1), None) if schema and "[" in setting else None
    if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
        return None
    fields = [f.name for f in dataclasses.fields(node)]
    close = difflib.get_close_matches(setting.rsplit(".", 1)[-1], fields, n=1, cutoff=0.6)
    return (f"did you mean {close[0]}? " if close else "") + f"an item has the keys {', '.join(fields)}"


def _explained(err: BaseException, overrides: list[str], conf_dir: Path) -> ConfigError:
    """Hydra's rejection as our ConfigError: the setting it names, its first line, our fix."""
    text = _messages(err)
    unparsable = _unparsable(overrides) if "override_grammar" in text or "no viable alternative" in text else None
    if unparsable is not None:
        return unparsable
    setting = _list_item(_setting(text, overrides), text, overrides)
    lines = text.strip().splitlines()
    problem = lines[0].rstrip(".") if lines else type(err).__name__
    if problem.startswith("Error merging override"):  # it only repeats the override: say what is wrong
        problem = next((line.rstrip(".") for line in lines if re.match(r"(Value|Key) '", line)), problem)
    expanded = _expanded_braces(overrides)
    fix = (f"quote the override, e.g. '{expanded}=[{{iteration:3,node:5}}]': the shell expanded its braces "
           f"into several {expanded}=[...] arguments" if expanded
           else _item_keys(setting, text) or _fix(setting, text, conf_dir))
    return ConfigError(setting, problem, fix)


def explain_composition_error(err: BaseException, overrides: list[str], conf_dir: Path) -> int:
    """Print the paragraph, write summary.json into the run folder (`hydra.run.dir` when the
    command line gives one, else `runs/<date>/<time>-config-error`), return the exit code."""
    error = _own_error(err) or _explained(err, overrides, conf_dir)
    stem = Path("runs") / time.strftime("%Y-%m-%d") / f"{time.strftime('%H-%M-%S')}-config-error"
    given = _given_run_dir(overrides)
    try:
        run_dir = _new_folder(stem) if given is None else given
        run_dir.mkdir(parents=True, exist_ok=True)
        summary = {"status": "error", "error": str(error), "overrides": overrides}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        where = f"\nRun folder: {run_dir}"
    except OSError:
        where = ""
    print(textwrap.fill(f"ftbench: {error}", width=100, break_on_hyphens=False) + where, file=sys.stderr)
    return EXIT_SETTING
