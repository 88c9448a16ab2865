"""Each setting declared once (kvd.common.settings, kvd.common.config_fields): what the declarations give,
and who may set what.

The declarations, on the fields of each process's config object, give its
default, the --help text, the errors for bad values and the flag tables in
docs/; every KVD_* variable that deploy/ (compose, the Kubernetes manifests,
the Dockerfiles), the README and docs/ set must be declared by the program
that reads it there, with a value valid for its type.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import tomllib
from pathlib import Path

import click
import pytest
import yaml

from gateway.config import GatewaySettings
from inference.config import EngineSettings
from kvd.common import config_fields
from kvd.common.config_fields import config_from, from_settings, nested, setting_of, settings_of
from kvd.common.settings import RETIRED_VARIABLES, SIZE, Setting, SettingsCommand, parse, parse_size, settings
from kvd.common.settings_docs import DOCS, PROGRAMS, command, readers, render, tables_in
from kvd.config import DaemonConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
#: Each server's frozen config object, whose fields declare its settings.
CONFIGS = {"kvd": DaemonConfig, "kvd-engine": EngineSettings, "kvd-gateway": GatewaySettings}
#: Variables docker compose itself reads (interpolated into the compose files); no process reads them.
COMPOSE_VARIABLES = {
    "KVD_IMAGE",
    "KVD_GPU_ID",
    "KVD_MODELS_DIR",
    "KVD_GATEWAY_PORT",
    "KVD_HTTP_PORT",
    "KVD_FLASH_ATTN",
    "KVD_REDIS_IMAGE",
}
#: Variables of the test suite, and the file that reads each.
TEST_VARIABLES = {
    "KVD_FUZZ_EXAMPLES": "tests/fuzz/test_public_rpcs.py",
    "KVD_FUZZ_RANDOM": "tests/fuzz/test_public_rpcs.py",
}
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str) -> str:
    """A compose value with each ``${VAR:-default}`` at its default (the variable unset)."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", str(text))


def declared(program: str) -> dict[str, Setting]:
    return {s.env: s for s in settings(command(program)) if s.env}


def check_value(program: str, name: str, value: str, where: str) -> None:
    setting = declared(program).get(name)
    assert setting is not None, f"{where}: {name} is set for {program}, which does not read it"
    try:
        setting.type.convert(value, setting, None)
    except click.BadParameter as exc:
        pytest.fail(f"{where}: {name}={value!r} is no valid {setting.opts[0]} of {program}: {exc.message}")


def build_config(program: str, environment: dict[str, str], where: str, monkeypatch) -> None:
    """Reads the program's settings from exactly ``environment`` and builds its config object."""
    with monkeypatch.context() as env:
        for name in [n for n in os.environ if n.startswith("KVD_")]:
            env.delenv(name)
        for name, value in environment.items():
            env.setenv(name, value)
        values = parse(command(program), [])
        if program in CONFIGS:
            try:
                config_from(CONFIGS[program], values)
            except ValueError as exc:
                pytest.fail(f"{where}: {program}'s settings are invalid: {exc}")


# ------------------------------------------------------------ declarations


def test_every_program_is_an_installed_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {p for p in PROGRAMS if " " not in p}
    for program, where in PROGRAMS.items():
        module = where.split(":")[0]
        assert scripts[program.split()[0]].split(":")[0] == module


@pytest.mark.parametrize("program", PROGRAMS)
def test_help_names_each_setting_with_its_variable_and_default(program):
    cmd = command(program)
    with cmd.make_context(program, [], resilient_parsing=True) as ctx:
        text = " ".join(cmd.get_help(ctx).split())
    for setting in settings(cmd):
        assert setting.opts[0] in text
        if setting.env:
            assert f"env var: {setting.env}" in text
        if setting.default_text:
            assert setting.default_text in text


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_program_reads_each_variable_once(program):
    names = [s.env for s in settings(command(program)) if s.env]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"KVD_[A-Z0-9_]+", n) for n in names)
    assert not set(names) & set(RETIRED_VARIABLES)


def test_a_variable_read_by_several_programs_means_the_same_in_each():
    for name, read in readers().items():
        first_program, first = read[0]
        for program, setting in read[1:]:
            where = f"{name}: {first_program} {first.opts[0]} vs {program} {setting.opts[0]}"
            assert type(setting.type) is type(first.type), where
            assert (setting.default, setting.default_text) == (first.default, first.default_text), where


@pytest.mark.parametrize(
    "main_module, argv, env, flag, variable",
    [
        ("kvd.cli", [], {"KVD_BLOCK_SIZE": "sixteen"}, "--block-size", "KVD_BLOCK_SIZE"),
        ("kvd.cli", [], {"KVD_MEMORY_BUDGET": "lots"}, "--memory-budget", "KVD_MEMORY_BUDGET"),
        ("kvd.cli", ["--host-memory-budget", "8 apples"], {}, "--host-memory-budget", "KVD_HOST_MEMORY_BUDGET"),
        ("kvd.cli", [], {"KVD_NO_PREFIX_CACHING": "maybe"}, "--no-prefix-caching", "KVD_NO_PREFIX_CACHING"),
        ("inference.cli", [], {"KVD_TOKEN_BUDGET": "1.5"}, "--token-budget", "KVD_TOKEN_BUDGET"),
        ("gateway.cli", [], {"KVD_ROUTING": "fastest"}, "--routing", "KVD_ROUTING"),
        ("gateway.cli", ["--route-load-factor", "high"], {}, "--route-load-factor", "KVD_ROUTE_LOAD_FACTOR"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag_and_the_variable(
    monkeypatch, capsys, main_module, argv, env, flag, variable
):
    import importlib

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(main_module).main(argv)  # refused before anything starts
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"'{flag}'" in error and f"'{variable}'" in error


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(monkeypatch):
    kvd = command("kvd")
    assert parse(kvd, []).block_size == 16
    monkeypatch.setenv("KVD_BLOCK_SIZE", "32")
    assert parse(kvd, []).block_size == 32
    assert parse(kvd, ["--block-size", "64"]).block_size == 64


def test_an_alias_sets_the_same_setting(monkeypatch):
    monkeypatch.delenv("KVD_ENGINES", raising=False)
    assert parse(command("kvd-gateway"), ["--engine", "a:1"]).engines == "a:1"
    assert parse(command("kvd-engine"), ["--dtype", "float16"]).dtype == "float16"


# ------------------------------------------------- fields that declare them


@pytest.mark.parametrize("program", CONFIGS)
def test_a_program_takes_every_setting_its_config_declares(program):
    assert set(settings_of(CONFIGS[program])) <= set(settings(command(program)))


@pytest.mark.parametrize("program", CONFIGS)
def test_a_config_built_in_code_has_the_command_lines_defaults(program, monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVD_")]:
        monkeypatch.delenv(name)
    config = CONFIGS[program]
    from_flags = config_from(config, parse(command(program), []))
    in_code = config()
    if config is DaemonConfig:  # its one exception: `auto` is resolved on the machine the daemon starts on
        assert in_code.device == "cpu"
        in_code = dataclasses.replace(in_code, device=from_flags.device)
    assert from_flags == in_code


@dataclasses.dataclass(frozen=True)
class _Depth:
    depth: int = config_fields.setting("--depth", type=click.INT, default=2, section="inner", help="how deep")


@dataclasses.dataclass(frozen=True)
class _Toy:
    size_bytes: int = config_fields.setting("--size", type=SIZE, default="1KiB", help="a size")
    caching: bool = config_fields.setting(
        "--no-caching", is_flag=True, default=False, convert=operator.not_, help="no caching"
    )
    names: list[str] = config_fields.setting(
        "--names", default="a,b", convert=lambda text: text.split(","), help="names"
    )
    inner: _Depth = nested(_Depth)
    label: str = from_settings(
        lambda values: f"{values.prefix}{values.depth}", Setting("--prefix", default="d", help="label prefix")
    )
    kept: float = 0.5  # no setting: a config built from flags keeps the default


def test_a_field_declares_its_setting_and_the_config_is_read_from_the_flags():
    assert [s.opts[0] for s in settings_of(_Toy)] == ["--size", "--no-caching", "--names", "--depth", "--prefix"]
    assert setting_of(_Toy, "size_bytes").opts == ["--size"]
    # the field's default is the setting's, converted; a mutable one made afresh
    assert _Toy() == _Toy(1024, True, ["a", "b"], _Depth(2), None, 0.5)
    assert _Toy().names is not _Toy().names
    toy = SettingsCommand("toy", settings_of(_Toy))
    argv = ["--size", "2KiB", "--no-caching", "--names", "x", "--depth", "3", "--prefix", "p"]
    assert config_from(_Toy, parse(toy, argv)) == _Toy(2048, False, ["x"], _Depth(3), "p3", 0.5)


@pytest.mark.parametrize(
    "text, size",
    [("4096", 4096), ("2GB", 2_000_000_000), ("512MiB", 512 << 20), ("1.5KiB", 1536), (" 8gib ", 8 << 30), ("0", 0)],
)
def test_sizes(text, size):
    assert parse_size(text) == size
    assert SIZE.convert(text, None, None) == size


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "5 PiB", "1e9"])
def test_a_bad_size_says_what_a_size_looks_like(text):
    with pytest.raises(click.BadParameter, match="not a size.*512MiB"):
        SIZE.convert(text, None, None)


# ------------------------------------------------------------------- docs


def test_the_docs_tables_are_what_the_declarations_write():
    """``make docs`` (python -m kvd.common.settings_docs) writes them; edit the declarations, not the tables."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        assert render(text) == text, f"{page.name}: a settings table differs from the declarations: run `make docs`"
        found += tables_in(text)
    assert sorted(found) == sorted([*PROGRAMS, "variables"]), "each program's table, and the variables', once"


# ----------------------------------------------- who sets what, and where


def compose_services(*files: str) -> dict[str, dict]:
    """The services of compose files layered like ``-f a -f b``: later environments add to earlier ones."""
    services: dict[str, dict] = {}
    for name in files:
        for service, spec in yaml.safe_load((DEPLOY / name).read_text())["services"].items():
            merged = services.setdefault(service, {"environment": {}})
            merged["environment"].update(spec.get("environment", {}))
            merged.setdefault("command", spec.get("command"))
    return services


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")])
def test_compose_services_set_only_what_their_program_reads(files, monkeypatch):
    text = "".join((DEPLOY / f).read_text() for f in files)
    for name in set(_INTERPOLATION.findall(text)):
        name = name[0]
        assert name in COMPOSE_VARIABLES or any(name in declared(p) for p in PROGRAMS), f"${{{name}}} is read by none"
        assert name in (DOCS / "deploy.md").read_text(), f"docs/deploy.md does not say what ${{{name}}} sets"
    for service, spec in compose_services(*files).items():
        program = (spec["command"] or [""])[0]
        if program not in PROGRAMS:
            continue  # redis
        environment = {key: interpolate(value) for key, value in spec["environment"].items()}
        for key, value in environment.items():
            check_value(program, key, value, f"{' + '.join(files)}: {service}")
        build_config(program, environment, f"{' + '.join(files)}: {service}", monkeypatch)


def kubernetes_documents() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_the_configmap_holds_only_what_the_containers_taking_it_read(monkeypatch):
    docs = kubernetes_documents()
    maps = {d["metadata"]["name"]: {k: str(v) for k, v in d["data"].items()} for d in docs if d["kind"] == "ConfigMap"}
    takers: dict[str, set[str]] = {}  # config map -> the programs of the containers that take it whole
    for doc in docs:
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            program = container.get("command", [""])[0]
            for source in container.get("envFrom", []):
                takers.setdefault(source["configMapRef"]["name"], set()).add(program)
            for var in container.get("env", []):
                if var["name"].startswith("KVD_"):
                    check_value(program, var["name"], str(var["value"]), f"k8s container {container['name']}")
    assert set(takers) == set(maps) and takers["kvd-config"] == {"kvd", "kvd-engine", "kvd-gateway"}
    for name, data in maps.items():
        for key, value in data.items():
            readers_here = [p for p in takers[name] if key in declared(p)]
            assert readers_here, f"ConfigMap {name}: {key} is read by none of {sorted(takers[name])}"
            for program in readers_here:
                check_value(program, key, value, f"ConfigMap {name}")
        for program in takers[name]:  # each takes the whole map and reads its own
            build_config(program, data, f"ConfigMap {name}", monkeypatch)


def dockerfile_variables(path: Path) -> dict[str, str]:
    text = path.read_text().replace("\\\n", " ")
    found = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            found |= dict(re.findall(r"(KVD_\w+)=(\S+)", line))
    return found


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_set_only_variables_their_programs_read(name):
    variables = dockerfile_variables(DEPLOY / name)
    assert variables, "the images set KVD_MODEL_CACHE_DIR (the model converted at build time)"
    for key, value in variables.items():
        programs = [p for p in PROGRAMS if key in declared(p)]
        assert programs, f"{name}: ENV {key} is read by no program"
        for program in programs:
            check_value(program, key, value, name)


def prose_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), DEPLOY / "models" / "README.md"]


def test_every_variable_the_docs_name_is_read_by_a_program_and_their_examples_are_valid():
    all_declared = set(readers())
    for page in prose_pages():
        text = page.read_text()
        for name in set(re.findall(r"\bKVD_[A-Z0-9_]*[A-Z0-9]\b", text)):
            if name in TEST_VARIABLES:
                assert name in (ROOT / TEST_VARIABLES[name]).read_text()
            else:
                known = all_declared | COMPOSE_VARIABLES | set(RETIRED_VARIABLES)
                assert name in known, f"{page.name} names {name}, which no program reads"
        # KVD_X=VALUE examples: valid for every program reading X (placeholders in capitals pass as text)
        for name, value in re.findall(r"\b(KVD_[A-Z0-9_]+)=([^\s`'\",;)]+)", text):
            for program, _ in readers().get(name, []):
                check_value(program, name, value, page.name)


def test_a_retired_variable_is_no_setting_and_the_docs_name_its_replacements():
    replacements = {"KVD_DTYPE": ("KVD_CACHE_DTYPE", "KVD_MODEL_DTYPE")}
    for name, message in RETIRED_VARIABLES.items():
        assert name not in readers()
        assert all(new in message and new in readers() for new in replacements[name])
