"""Templates of the files ``opbridge new`` writes (``string.Template`` syntax: ``${name}``).

They are package data: the opbridge wheel must include ``scaffold/templates/*/*.tmpl``.
"""

from __future__ import annotations

from importlib import resources
from string import Template

from opbridge.errors import OpbridgeError


def render(template: str, **values: object) -> str:
    """Fill *template* (``"op/kernel.cc.tmpl"``) with *values*; every placeholder must be given.

    Raises
    ------
    OpbridgeError
        If the template is missing from this installation.
    KeyError
        If a placeholder has no value.
    """
    path = resources.files(__name__).joinpath(*template.split("/"))
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise OpbridgeError(f"scaffold template {template} is missing from this installation "
                            f"(package data opbridge/scaffold/templates/*/*.tmpl)") from None
    return Template(text).substitute({k: str(v) for k, v in values.items()})
