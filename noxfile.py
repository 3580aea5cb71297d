"""nox sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``, ``nox -s docs``, ``nox -s bench``."""

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (the README's test command)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, tests and benchmarks."""
    session.install("ruff")
    # B023: closures called inside the loop that defines them (timing lambdas);
    # B905: zip(strict=) is not wanted where lengths differ on purpose.
    session.run("ruff", "check", "--select", "E,F,W,B", "--ignore", "E501,B008,B023,B905",
                "yrcache", "tests", "bench")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the package (mypy.ini)."""
    session.install("-e", ".[typecheck,cluster]")
    session.run("mypy", "yrcache", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml), warnings as errors."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """All benchmarks; figures go to docs/benchmarks.md by hand, with the command."""
    session.install("-e", ".[all,bench]")
    for script in ("bench_store.py", "bench_tiers.py", "bench_rl_sync.py", "bench_rl_scale.py", "gpu_check.py"):
        session.run("python", f"bench/{script}", *session.posargs)
    # peers that are not installed (ray, vineyard: `pip install ray vineyard 'setuptools<81'`;
    # redis-server from the OS) are skipped with a message
    session.run("python", "bench/compare.py", *session.posargs)
