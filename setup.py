"""Package discovery: the repository's folders, installed under the one ``fleet`` namespace.

The folders stay where a maintainer expects them (``controlplane/``, ``agent/``,
``workers/``, ``proto/``); installed, each is a subpackage of ``fleet`` so that no
generic top-level name (``agent``, ``workers``) is taken from other distributions.
Every package below a root is found, never listed by hand. Metadata lives in
pyproject.toml.
"""

from setuptools import find_packages, setup

#: installed name -> repository folder; every package below a folder is installed too
ROOTS = {
    "fleet": "fleet",
    "fleet.controlplane": "controlplane",
    "fleet.agent": "agent",
    "fleet.workers": "workers",
    "fleet.proto": "proto/fleet/proto",
}


def _discover() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return found


setup(
    packages=[*_discover(), "fleet.examples"],
    package_dir={**ROOTS, "fleet.examples": "examples"},
    package_data={
        "fleet.proto": ["*.proto", "*.pyi"],
        "fleet.controlplane.store.migrations": ["*.mako"],
        "fleet.examples": ["*.yaml"],
    },
)
