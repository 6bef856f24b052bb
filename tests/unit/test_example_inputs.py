"""The example tools' input models are strict: what an agent sends is what gets
recorded, with no lax coercion (``True`` is not an amount of 1 cent, ``"100"`` is not
100). The sandbox tools are covered in test_sandbox_tools.py."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from support import sample_tools

REPOSITORY = Path(__file__).resolve().parents[2]


def quickstart_model(name: str) -> type[BaseModel]:
    """The class from examples/quickstart.py, without running the script (it connects
    to a database at import)."""
    tree = ast.parse((REPOSITORY / "examples" / "quickstart.py").read_text(encoding="utf-8"))
    wanted: list[ast.stmt] = [
        node
        for node in tree.body
        if (isinstance(node, ast.ImportFrom) and node.module in ("__future__", "pydantic"))
        or (isinstance(node, ast.ClassDef) and node.name == name)
    ]
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "quickstart.py", "exec"), namespace)
    model: type[BaseModel] = namespace[name]
    return model


@pytest.mark.parametrize(
    "model",
    [quickstart_model("RefundInput"), sample_tools.RefundInput],
    ids=["quickstart", "sample_tools"],
)
@pytest.mark.parametrize("amount", [True, "1250", 1250.0])
def test_a_refund_amount_must_be_an_integer_not_something_that_coerces_to_one(
    model: type[BaseModel], amount: object
) -> None:
    assert model.model_validate({"payment_id": "pay_1", "amount_cents": 1250})

    with pytest.raises(ValidationError) as refused:
        model.model_validate({"payment_id": "pay_1", "amount_cents": amount})

    assert [error["loc"] for error in refused.value.errors()] == [("amount_cents",)]


def test_a_ticket_title_must_be_a_string() -> None:
    with pytest.raises(ValidationError):
        sample_tools.TicketInput.model_validate({"title": b"bytes"})
