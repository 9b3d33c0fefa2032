"""integrity.verify_once: the CRCs are read on the first check only, while the file stays the same."""

import os
import shutil

import pytest
from nanoqwen_format import NanoqwenFormatError, open_model
from nanoqwen_format.integrity import forget, is_verified, record_path, verify_once


@pytest.fixture
def model(tmp_path, synthetic_file):
    path = tmp_path / "m.nanoqwen"
    shutil.copyfile(synthetic_file, path)
    return path


def _flip_bit(path, index: int, byte: int = 0, bit: int = 0) -> str:
    """Flip one bit of the data of the file's tensor number `index` and put the file's mtime back, as a
    silent disk fault would; returns that tensor's name."""
    with open_model(path) as m:
        tensor = m.tensor_names[index]
        offset = m.tensor_info(tensor)["offset"] + byte
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return tensor


def test_first_check_reads_later_ones_trust_the_record(model, tmp_path):
    records = tmp_path / "records"
    assert not is_verified(model, records)
    assert verify_once(model, records) is True
    assert is_verified(model, records) and record_path(model, records).is_file()
    assert verify_once(model, records) is False
    assert verify_once(model, records, force=True) is True


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_bit_fails_naming_file_and_tensor(model, tmp_path, where):
    tensor = _flip_bit(model, 0 if where == "first" else -1, byte=7, bit=3)
    with pytest.raises(NanoqwenFormatError, match="CRC32 mismatch") as e:
        verify_once(model, tmp_path / "records")
    assert str(model) in str(e.value) and tensor in str(e.value)
    assert not is_verified(model, tmp_path / "records"), "a failed check is not recorded"


def test_a_changed_file_is_checked_again(model, tmp_path):
    records = tmp_path / "records"
    verify_once(model, records)
    tensor = _flip_bit(model, 1)
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the file was rewritten: a new mtime
    with pytest.raises(NanoqwenFormatError, match=tensor):
        verify_once(model, records)


def test_a_fault_behind_an_unchanged_identity_needs_force(model, tmp_path):
    """The documented limit: the record trusts size, mtime and inode."""
    records = tmp_path / "records"
    verify_once(model, records)
    tensor = _flip_bit(model, 2)
    assert verify_once(model, records) is False
    with pytest.raises(NanoqwenFormatError, match=tensor):
        verify_once(model, records, force=True)


def test_forget_and_unwritable_records(model, tmp_path):
    records = tmp_path / "records"
    verify_once(model, records)
    forget(model, records)
    assert not is_verified(model, records)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the record directory would go")
    assert verify_once(model, blocked) is True, "a record that cannot be written costs a check, not the load"
    assert verify_once(model, blocked) is True


def test_missing_and_damaged_headers(tmp_path):
    with pytest.raises(NanoqwenFormatError, match="cannot open"):
        verify_once(tmp_path / "missing.nanoqwen", tmp_path / "records")
    bogus = tmp_path / "bogus.nanoqwen"
    bogus.write_bytes(b"NOTNANOQ" + bytes(4096))
    with pytest.raises(NanoqwenFormatError, match="bogus.nanoqwen"):
        verify_once(bogus, tmp_path / "records")
