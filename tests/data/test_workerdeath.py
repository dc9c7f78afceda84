

def test_a_process_out_of_file_descriptors_says_what_to_raise_or_lower():
    """`ulimit -n` too small for the loader workers: PyTorch's "Too many open files.
    Communication with the workers is no longer possible" was a 122-line traceback, an
    OSError naming no file a bare `[Errno 24] Too many open files`."""
    import errno
    import resource

    from data.workerdeath import worker_died
    from trainer.oneline import describe

    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    line = (f"the process ran out of file descriptors (ulimit -n is {limit}): raise the limit "
            "(ulimit -n 65536 in the job's shell), or use fewer loader workers "
            "(data.num_workers), which hand batches over through them")
    torch_s = RuntimeError("Too many open files. Communication with the workers is no longer "
                           "possible. Please increase the limit using `ulimit -n` ...")
    assert str(worker_died(torch_s)) == line
    assert str(worker_died(OSError(errno.EMFILE, "Too many open files"))) == line
    assert describe(OSError(errno.EMFILE, "Too many open files")) == line
    assert worker_died(OSError(errno.ENOSPC, "No space left on device")) is None
