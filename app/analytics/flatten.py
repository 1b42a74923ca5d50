"""Turn one protobuf event into a flat row of scalars, and a row into one readable line.

Flattening rules (stable, so exported tables keep their columns from run to run):

* scalar fields keep their value, including proto3 zero defaults; a field with explicit presence
  (``optional``, sub-messages) that is unset becomes None;
* enums become their value name (``KIND_FINISHED``);
* sub-messages are flattened with dotted names (``lease.device_id``);
* maps become one column per key (``metrics.loss``);
* repeated fields become their length, named ``<field>.count`` (token ids are for the trajectory
  store, not for a table of events).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

Scalar = str | int | float | bool | None


def flatten(msg: Message, prefix: str = "") -> dict[str, Scalar]:
    """Flat {dotted field name: scalar} of `msg` (see the module docstring for the rules)."""
    row: dict[str, Scalar] = {}
    for field in msg.DESCRIPTOR.fields:
        name = prefix + field.name
        value: Any = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for key in sorted(value):
                row[f"{name}.{key}"] = _scalar(field.message_type.fields_by_name["value"], value[key], name)
        elif _is_repeated(field):
            row[f"{name}.count"] = len(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if msg.HasField(field.name):
                row.update(flatten(value, prefix=name + "."))
            else:
                row[name] = None
        elif field.has_presence and not msg.HasField(field.name):
            row[name] = None
        else:
            row[name] = _scalar(field, value, name)
    return row


def _is_repeated(field: Any) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 6.31 deprecates `label`
    if is_repeated is not None:
        return bool(is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def _scalar(field: Any, value: Any, name: str) -> Scalar:
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(int(value))
        return enum_value.name if enum_value is not None else int(value)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return str(value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return len(value)
    return value  # type: ignore[no-any-return]


def one_line(row: dict[str, Scalar], *, skip: tuple[str, ...] = ("event_id", "run_id")) -> str:
    """`key=value` pairs of the non-empty fields of a flat row, floats with 4 significant digits."""
    parts = []
    for key, value in row.items():
        if key in skip or value is None or value == "" or value == 0 and key.endswith(".count"):
            continue
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif isinstance(value, str) and (" " in value or not value):
            parts.append(f"{key}={value!r}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)
