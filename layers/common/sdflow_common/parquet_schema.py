"""A parquet object's columns and row count, read from its footer with one or two small ranged GETs.

The download job rejects a file that is not parquet, lacks the URL or caption column, holds no
URL strings or has no rows (training_image/sdflow_image/download/download.py, validate_parquet). Those
failures are deterministic, so intake checks the same things before any job starts.

Layout (Apache Parquet, "File Format"): `PAR1 <data> <FileMetaData> <4-byte little-endian length
of FileMetaData> PAR1`; a footer-encrypted file ends in `PARE` instead. FileMetaData is a Thrift
struct in the compact protocol (parquet.thrift): field 2 is `list<SchemaElement> schema` (the
schema tree flattened depth first, the root first) and field 3 `i64 num_rows`. Both come before
the row groups, so reading the footer's start is enough. SchemaElement: 1 `type` (physical type,
6 = BYTE_ARRAY), 4 `name`, 5 `num_children`, 6 `converted_type` (0 = UTF8), 10 `logicalType`
(a union whose field 1 is STRING). pyarrow reads a column as a string exactly when it is a
BYTE_ARRAY annotated UTF8 or STRING."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import ClientError
from thrift.protocol.TCompactProtocol import TCompactProtocol
from thrift.Thrift import TException, TType
from thrift.transport.TTransport import TMemoryBuffer

MAGIC = b"PAR1"
ENCRYPTED_MAGIC = b"PARE"
TRAILER_BYTES = 8  # footer length + magic
# One GET of the object's last bytes usually holds the whole footer; otherwise a second GET reads
# the footer's start, where the schema is, up to SCHEMA_READ_LIMIT bytes.
FIRST_READ = 16 * 1024
SCHEMA_READ_LIMIT = 4 * 1024 * 1024
# Bounds for a corrupt footer: a LAION file has a dozen columns.
MAX_SCHEMA_ELEMENTS = 100_000
MAX_STRING_BYTES = 64 * 1024

BYTE_ARRAY = 6
CONVERTED_UTF8 = 0
# Physical types pyarrow reads as numbers (int32, int64, float, double), unless an annotation makes them a
# date, a time, a timestamp or a decimal (ConvertedType 5-10, LogicalType 5-8), which a filter's number bound
# cannot be compared with. Integer annotations (ConvertedType INT_8 … UINT_64, LogicalType INTEGER) stay numbers.
NUMERIC_PHYSICAL = frozenset({1, 2, 4, 5})
NOT_NUMBER_CONVERTED = {5: "decimal", 6: "date", 7: "time", 8: "time", 9: "timestamp", 10: "timestamp"}
NOT_NUMBER_LOGICAL = {5: "decimal", 6: "date", 7: "time", 8: "timestamp"}
PHYSICAL_TYPES = {
    0: "boolean",
    1: "int32",
    2: "int64",
    3: "int96",
    4: "float",
    5: "double",
    6: "binary",
    7: "fixed_len_byte_array",
}


class NotParquet(ValueError):
    """The bytes are not a readable parquet file; the message says what was found."""


class SchemaTooLarge(ValueError):
    """The footer's schema is beyond SCHEMA_READ_LIMIT bytes: too large to check at intake."""


@dataclass(frozen=True)
class Column:
    name: str
    physical_type: int | None = None
    converted_type: int | None = None
    logical_string: bool = False
    num_children: int = 0
    logical_type: int | None = None  # the LogicalType union's field id (1 STRING, 8 TIMESTAMP, …)

    @property
    def is_string(self) -> bool:
        return (
            self.num_children == 0
            and self.physical_type == BYTE_ARRAY
            and (self.converted_type == CONVERTED_UTF8 or self.logical_string)
        )

    @property
    def annotation(self) -> str | None:
        """What a date, time, timestamp or decimal annotation makes of a numeric physical type."""
        return NOT_NUMBER_LOGICAL.get(self.logical_type or -1) or NOT_NUMBER_CONVERTED.get(
            -1 if self.converted_type is None else self.converted_type
        )

    @property
    def is_number(self) -> bool:
        """Whether pyarrow reads the column as integers or floating-point numbers."""
        return self.num_children == 0 and self.physical_type in NUMERIC_PHYSICAL and self.annotation is None

    @property
    def type_name(self) -> str:
        if self.num_children:
            return "a nested group"
        if self.annotation is not None:
            return self.annotation
        if self.is_string:
            return "string"
        if self.physical_type == BYTE_ARRAY and not self.is_string:
            return "binary (not UTF-8 text)"
        return PHYSICAL_TYPES.get(-1 if self.physical_type is None else self.physical_type, "an unknown type")


@dataclass(frozen=True)
class ParquetSchema:
    columns: dict[str, Column] = field(default_factory=dict)
    num_rows: int = 0


def _read_schema_element(proto: TCompactProtocol) -> Column:
    values: dict[str, Any] = {}
    proto.readStructBegin()
    while True:
        _name, ttype, fid = proto.readFieldBegin()
        if ttype == TType.STOP:
            break
        if fid == 1 and ttype == TType.I32:
            values["physical_type"] = proto.readI32()
        elif fid == 4 and ttype == TType.STRING:
            values["name"] = proto.readString()
        elif fid == 5 and ttype == TType.I32:
            values["num_children"] = proto.readI32()
        elif fid == 6 and ttype == TType.I32:
            values["converted_type"] = proto.readI32()
        elif fid == 10 and ttype == TType.STRUCT:
            values["logical_type"] = _union_field(proto)
            values["logical_string"] = values["logical_type"] == 1
        else:
            proto.skip(ttype)
        proto.readFieldEnd()
    proto.readStructEnd()
    if "name" not in values:
        raise NotParquet("a schema element has no name")
    return Column(**values)


def _union_field(proto: TCompactProtocol) -> int | None:
    """The id of the field a Thrift union holds (LogicalType: 1 = STRING)."""
    chosen = None
    proto.readStructBegin()
    while True:
        _name, ttype, fid = proto.readFieldBegin()
        if ttype == TType.STOP:
            break
        chosen = fid
        proto.skip(ttype)
        proto.readFieldEnd()
    proto.readStructEnd()
    return chosen


def _top_level(elements: list[Column]) -> dict[str, Column]:
    """The root's children, skipping each one's subtree (the list is the tree, depth first)."""
    if not elements or elements[0].num_children < 0:
        raise NotParquet("the schema has no root")
    columns: dict[str, Column] = {}
    index = 1
    for _ in range(elements[0].num_children):
        if index >= len(elements):
            raise NotParquet("the schema lists fewer columns than its root announces")
        columns[elements[index].name] = elements[index]
        pending = 1
        while pending:
            if index >= len(elements) or elements[index].num_children < 0:
                raise NotParquet("the schema tree is inconsistent")
            pending += elements[index].num_children - 1
            index += 1
    return columns


def parse_file_metadata(data: bytes) -> ParquetSchema:
    """Columns and row count from the start of a FileMetaData struct (thrift compact protocol).

    NotParquet when the bytes are not a footer; EOFError when they stop before the row count."""
    proto = TCompactProtocol(
        TMemoryBuffer(data), string_length_limit=MAX_STRING_BYTES, container_length_limit=MAX_SCHEMA_ELEMENTS
    )
    elements: list[Column] | None = None
    num_rows: int | None = None
    try:
        proto.readStructBegin()
        while elements is None or num_rows is None:
            _name, ttype, fid = proto.readFieldBegin()
            if ttype == TType.STOP:
                break
            if fid == 2 and ttype == TType.LIST:
                etype, size = proto.readListBegin()
                if etype != TType.STRUCT:
                    raise NotParquet("the schema is not a list of elements")
                elements = [_read_schema_element(proto) for _ in range(size)]
                proto.readListEnd()
            elif fid == 3 and ttype == TType.I64:
                num_rows = proto.readI64()
            else:
                proto.skip(ttype)
            proto.readFieldEnd()
    except EOFError:
        raise
    except (TException, KeyError, ValueError, IndexError) as exc:
        # The protocol reader meets garbage as unknown type ids (KeyError), bad UTF-8 (ValueError),
        # or its own limits (TProtocolException): all mean "not a parquet footer".
        if isinstance(exc, NotParquet):
            raise
        raise NotParquet(f"its footer cannot be decoded ({type(exc).__name__})") from exc
    if elements is None or num_rows is None:
        raise NotParquet("its footer has no schema or no row count")
    return ParquetSchema(columns=_top_level(elements), num_rows=num_rows)


def _trailer_footer_length(tail: bytes, size: int) -> int:
    if size < len(MAGIC) + TRAILER_BYTES:
        raise NotParquet(f"it is {size} bytes, too short for a parquet file")
    magic = tail[-len(MAGIC) :]
    if magic == ENCRYPTED_MAGIC:
        raise NotParquet("its footer is encrypted; the download job cannot read encrypted parquet files")
    if magic != MAGIC:
        raise NotParquet("it does not end with the parquet marker PAR1 (is it CSV, JSON or compressed?)")
    length = int.from_bytes(tail[-TRAILER_BYTES : -len(MAGIC)], "little")
    if length == 0 or length + TRAILER_BYTES + len(MAGIC) > size:
        raise NotParquet(f"its footer length ({length} bytes) does not fit in the file ({size} bytes)")
    return length


def _object_size(response: dict[str, Any]) -> int:
    content_range = str(response.get("ContentRange") or "")
    if "/" in content_range:
        return int(content_range.rsplit("/", 1)[1])
    return int(response.get("ContentLength") or 0)


def read_schema(s3: Any, bucket: str, key: str) -> ParquetSchema:
    """The object's columns and row count. NotParquet for anything the download job could not read;
    SchemaTooLarge when the schema alone is beyond SCHEMA_READ_LIMIT; ClientError (NoSuchKey, …) as is."""
    try:
        response = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=-{FIRST_READ}")
    except ClientError as exc:
        # A suffix range of an empty object is unsatisfiable.
        if str(exc.response.get("Error", {}).get("Code", "")) in ("InvalidRange", "416"):
            raise NotParquet("it is empty (0 bytes)") from exc
        raise
    tail = response["Body"].read()
    size = _object_size(response)
    length = _trailer_footer_length(tail, size)
    if length + TRAILER_BYTES <= len(tail):
        try:
            return parse_file_metadata(tail[-TRAILER_BYTES - length : -TRAILER_BYTES])
        except EOFError as exc:
            raise NotParquet("its footer ends before the schema does") from exc
    start = size - TRAILER_BYTES - length
    wanted = min(length, SCHEMA_READ_LIMIT)
    head = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + wanted - 1}")["Body"].read()
    try:
        return parse_file_metadata(head)
    except EOFError as exc:
        if wanted < length:
            raise SchemaTooLarge(f"its schema is larger than {SCHEMA_READ_LIMIT} bytes") from exc
        raise NotParquet("its footer ends before the schema does") from exc
