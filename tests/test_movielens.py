import pandas as pd
import pyarrow.parquet as pq
import pytest

from solaris_jobs.core import events as ev
from solaris_jobs.data import movielens


def test_real_movielens_100k(movielens_root):
    m = ev.read_manifest(movielens_root)
    assert (m["events"], m["users"], m["items"], m["rejected"]) == (100_000, 943, 1_682, 0)
    table = ev.read_events(movielens_root)
    df = table.to_pandas()
    assert len(df) == 100_000
    assert ((df["rating"] >= 4) == (df["label"] == 1)).all()
    assert df["event_timestamp"].min() == pd.Timestamp("1997-09-20T03:05:10Z")
    users, items = ev.read_side(movielens_root, "users"), ev.read_side(movielens_root, "items")
    assert len(users) == 943 and len(items) == 1682
    assert users["occupation"].between(1, len(movielens.OCCUPATIONS)).all()
    # Toy Story (item 1) is Animation, Children's, Comedy.
    toy = items.loc[items["item_id"] == 1, "genres"].iloc[0]
    assert sorted(toy) == sorted(movielens.GENRES.index(g) + 1 for g in ["Animation", "Children's", "Comedy"])


def _grouplens(folder, data_lines):
    folder.mkdir()
    (folder / "u.data").write_text("\n".join(data_lines) + "\n")
    (folder / "u.user").write_text("1|24|M|technician|85711\n2|53|F|other|94043\n")
    genres = "|".join(["0"] * 19)
    (folder / "u.item").write_bytes(
        f"10|Café (1995)|01-Jan-1995||http://x|{genres}\n11|B (1996)|01-Jan-1996||http://y|{genres}\n"
        .encode("latin-1"))
    return folder


def test_malformed_rows_are_set_aside_with_reasons(tmp_path):
    src = _grouplens(tmp_path / "gl", [
        "1\t10\t5\t881250949",
        "2\t11\t3\t881250950",
        "x\t10\t4\t881250951",          # bad user id
        "1\t11\t7\t881250952",          # rating out of range
        "1\t10\t4",                     # missing a column
        "1\t10\t5\t881250949",          # duplicate of line 1
    ])
    m = movielens.build(tmp_path / "out", source=src)
    assert m["events"] == 2 and m["rejected"] == 4
    rejects = pq.read_table(tmp_path / "out" / "rejects" / "movielens.parquet").to_pandas()
    by_line = dict(zip(rejects["line"], rejects["reason"]))
    assert by_line[3] == "column user_id has value 'x'"
    assert by_line[4] == "column rating has value '7'"
    assert by_line[5] == "wrong number of columns"
    assert by_line[6].startswith("duplicate")
    assert set(rejects["source"]) == {str(src / "u.data")}
    items = ev.read_side(tmp_path / "out", "items")
    assert items["release_decade"].tolist() == [10, 10]     # 1990s

    # A side table with an id twice: the first row is kept, the later one set aside and counted (it used to
    # give the id two rows, and the side table's lookup kept whichever came last).
    with open(src / "u.user", "a") as f:
        f.write("2|30|M|writer|10001\n")
    with open(src / "u.item", "ab") as f:
        f.write(f"10|Again (1980)|01-Jan-1980||http://z|{'|'.join(['0'] * 19)}\n".encode("latin-1"))
    m = movielens.build(tmp_path / "out2", source=src)
    assert m["rejected"] == 6 and m["users"] == 2 and m["items"] == 2
    assert m["rejected_by_reason"]["duplicate user_id"] == m["rejected_by_reason"]["duplicate item_id"] == 1
    rejects = pq.read_table(tmp_path / "out2" / "rejects" / "movielens.parquet").to_pandas().set_index("source")
    assert rejects.loc[str(src / "u.user"), "reason"] == "duplicate user_id has value '2' (line 2 has it and is kept)"
    assert rejects.loc[str(src / "u.item"), "line"] == 3
    users = ev.read_side(tmp_path / "out2", "users")
    assert users.set_index("user_id").loc[2, "gender"] == 2           # the first row's F, not the later M
    assert ev.read_side(tmp_path / "out2", "items").set_index("item_id").loc[10, "release_decade"] == 10


def test_wrong_file_names_file_and_column(tmp_path):
    src = _grouplens(tmp_path / "gl", ["1,10,5,881250949", "2,11,3,881250950"])     # commas, not tabs
    with pytest.raises(ev.DataContractError, match=r"u\.data: no line has the expected 4 columns"):
        movielens.build(tmp_path / "out", source=src)
    (tmp_path / "gl" / "u.data").unlink()
    with pytest.raises(ev.DataContractError, match=r"u\.data: file not found"):
        movielens.build(tmp_path / "out", source=src)


def test_empty_files_are_named_and_a_byte_order_mark_costs_no_row(tmp_path):
    src = _grouplens(tmp_path / "gl", ["1\t10\t5\t881250949", "2\t11\t3\t881250950"])
    data = (src / "u.data").read_bytes()
    (src / "u.data").write_bytes(b"\xef\xbb\xbf" + data)
    (src / "u.item").write_bytes(b"\xef\xbb\xbf" + (src / "u.item").read_bytes())
    m = movielens.build(tmp_path / "out", source=src)
    assert m["events"] == 2 and m["rejected"] == 0
    assert sorted(ev.read_side(tmp_path / "out", "items")["item_id"]) == [10, 11]
    for name in ("u.data", "u.user", "u.item"):
        keep = (src / name).read_bytes()
        (src / name).write_bytes(b"")
        with pytest.raises(ev.DataContractError, match=rf"{name.replace('.', '[.]')}: no data lines \(empty file\)"):
            movielens.build(tmp_path / "out2", source=src)
        (src / name).write_bytes(keep)


def test_recbole_header_missing_column(tmp_path):
    import io
    frame = movielens._read_delimited(io.StringIO("user_id:token\titem_id:token\ttimestamp:float\n1\t2\t3\n"),
                                      "\t", "ml-100k.inter", header=True)
    raw = movielens.RawTables(frame, frame, frame, {"inter": "ml-100k.inter", "users": "u", "items": "i"})
    with pytest.raises(ev.DataContractError, match=r"ml-100k\.inter: required column 'rating' is missing"):
        movielens.to_contract(raw)
