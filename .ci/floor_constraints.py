"""Print pip constraints pinning every requirement in pyproject.toml to its declared floor (`name>=X` -> `name==X`;
an exact pin `name==X` is its own floor).

`make test-floor` installs the package under these constraints, so that CI runs on the oldest versions we allow and
not only on the newest. Every requirement must declare a floor: one without `>=` or `==` is an error naming it.
"""

import re
import sys
import tomllib
from pathlib import Path

FLOOR = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:>=|==)\s*([0-9][^,;\s]*)\s*$")


def floors(pyproject: dict) -> dict[str, str]:
    project = pyproject["project"]
    requirements = [*pyproject["build-system"]["requires"], *project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    pins = {}
    for requirement in requirements:
        match = FLOOR.match(requirement)
        if match is None:
            sys.exit(f"floor_constraints: {requirement!r} in pyproject.toml has no single '>=' floor or '==' pin")
        pins[match[1]] = match[2]
    return pins


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    for name, version in floors(tomllib.loads(path.read_text())).items():
        print(f"{name}=={version}")
