"""Shared by the scripts that write a modified copy of a GGUF file
(tiny_reranker.py, tiny_fim.py) with the `gguf` package."""

import gguf


def copy_field(writer, field):
    """Copies one key/value field as it is typed in the source."""
    vtype = field.types[0]
    value = field.contents()
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, vtype, sub_type=sub)
    else:
        writer.add_key_value(field.name, value, vtype)
