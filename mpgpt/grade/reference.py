"""The package's own implementation behind each graded interface, as a file a learner would hand in.

The grader's tests check that each of these passes every behaviour, and the GPU check
(benchmarks/lab_gpu_check.py) grades them with the kernels compiled. An instructor can grade one
the same way to see the grader pass: write it to a file and run `python -m mpgpt.grade NAME FILE`.
"""
import textwrap

REFERENCE = {
    "ch1-rounding": textwrap.dedent("""
        import struct
        from mpgpt.formats import encode_nearest_even

        def round_fp32_bits(bits, fmt):
            return encode_nearest_even(struct.unpack("<f", struct.pack("<I", bits))[0], fmt)
        """),
    "ch5-scaler": "from mpgpt.scaling import DynamicLossScaler\n",
    "ch6-matmul": textwrap.dedent("""
        from mpgpt.kernels import grouped, interpreting

        def matmul(a, b, c):
            grouped.launch(a, b, c, interpreted=interpreting())
        """),
    "lab-nans-hooks": "from mpgpt.labs.nonfinite import first_nonfinite_module\n",
}
