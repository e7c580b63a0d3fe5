"""The recipe file (`--config`): found among the arguments and read, a missing or malformed one a ConfigError naming
it. Light on purpose: the entry point reads it before any library is imported (`sft.train.run`), so that a typo in a
path costs a tenth of a second, not the import of torch; `sft.config` reads it the same way when it parses."""

from __future__ import annotations

from pathlib import Path

import yaml

from sft.errors import ConfigError

# A data source's file types, by suffix, and the `datasets` builder that reads each (sft.data.load)
DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def missing_local_source(path: str) -> bool:
    """Whether a source's `path` names a local file or directory (by its suffix or a leading . or /) that does not
    exist; a name like `org/name` is a hub id, which only loading can check."""
    local = Path(path)
    return not local.exists() and (local.suffix in DATA_FILE_BUILDERS or path.startswith((".", "/")))


class _DuplicateKey(Exception):
    def __init__(self, key, first: int, again: int):
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep)


def recipe_path(args: list[str]) -> Path | None:
    """The path after `--config` in the arguments, or None without one."""
    if "--config" not in args:
        return None
    index = args.index("--config")
    if index + 1 >= len(args):
        raise ConfigError("`--config` needs a path to a YAML recipe, e.g. --config recipes/demo.yaml.")
    return Path(args[index + 1])


def with_config(args: list[str], prog: str) -> list[str]:
    """The arguments with the recipe as `--config RECIPE`: every subcommand that reads a recipe takes it that way and
    as its first argument (`sft data RECIPE`, `sft check RECIPE`, `sft train RECIPE`); both at once is an error."""
    args = list(args)
    if not args or args[0].startswith("-") or not args[0].endswith((".yaml", ".yml")):
        return args
    if "--config" in args:
        other = " ".join(args[args.index("--config") : args.index("--config") + 2])
        raise ConfigError(
            f"the recipe is given twice, {args[0]} and `{other}`: give it once, `{prog} --config RECIPE`."
        )
    return ["--config", *args]


def read_recipe(path: Path) -> dict:
    """The recipe's mapping; a missing file, invalid YAML, a key given twice or a non-mapping is a ConfigError."""
    if not path.is_file():
        raise ConfigError(f"`--config`: no such file {str(path)!r}. Recipes live in recipes/, e.g. recipes/demo.yaml.")
    try:
        recipe = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as e:
        raise ConfigError(
            f"{path}: key `{e.key}` is given twice (lines {e.first} and {e.again}); YAML would silently keep the "
            "second. Keep one of them."
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"`--config`: {path} is not valid YAML: {e}") from e
    if not isinstance(recipe, dict):
        raise ConfigError(f"`--config`: {path} must hold a YAML mapping of field: value, got {type(recipe).__name__}.")
    return recipe


def read_recipe_in(args: list[str]) -> dict | None:
    """The recipe the arguments name after `--config`, read (`read_recipe`); None without one (every field given on
    the command line)."""
    path = recipe_path(args)
    return None if path is None else read_recipe(path)
