"""enqueue's percent is of the rows handed on, placed between the positions the reading thread
noted after each chunk (genq.producer.sources; the CLI's lines: tests/test_enqueue_progress.py)."""

from __future__ import annotations

from genq.producer.sources import Meter


def test_the_percent_is_of_the_rows_handed_on_not_of_the_rows_read():
    meter = Meter()
    meter.of_rows(1000)
    meter.read_upto(100, 100)
    meter.read_upto(200, 300)  # read ahead: 30% read
    meter.settle(50)
    assert meter.fraction() == 0.05
    meter.settle(150)  # half of the second chunk, which ends at 300: halfway from 100
    assert meter.fraction() == 0.2
    meter.settle(120)  # rows held back again never move the percent back
    assert meter.fraction() == 0.2
    meter.settle(200)
    assert meter.fraction() == 0.3
    meter.finish()
    assert meter.fraction() == 1.0


def test_no_percent_when_the_size_is_not_known():
    meter = Meter()  # a stream whose size is not known: total 0
    meter.read_upto(10, 10)
    meter.settle(10)
    assert meter.fraction() is None


def test_a_gz_input_that_cannot_tell_its_position_is_read_to_the_end(tmp_path):
    """A .gz input through a FIFO (a pipe cannot tell()): the meter's position is its total, no OSError
    in the reading thread that would end the enqueue."""
    import gzip
    import json
    import os
    import threading

    from genq.producer.sources import open_rows

    fifo = tmp_path / "in.jsonl.gz"
    os.mkfifo(fifo)
    data = gzip.compress(b"".join(json.dumps({"id": f"p{i}", "prompt": "hi"}).encode() + b"\n" for i in range(50)))
    writer = threading.Thread(target=fifo.write_bytes, args=(data,))
    writer.start()
    meter = Meter()
    rows = open_rows(str(fifo), endpoint="chat", meter=meter)
    read = [next(rows)]
    assert meter.position() == meter.total == 0  # as enqueue's reader asks after each chunk: no size known
    read += list(rows)
    writer.join()
    assert len(read) == 50 and meter.fraction() is None
