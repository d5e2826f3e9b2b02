"""Quantised weights and the kernels that multiply them: dgemma's int8/int4 layout and modules
(quantize.py), int8 compute on a CPU (int8_compute.py), OpenVINO's int4 kernels for the routed experts
(openvino.py, the cpu-kernels extra), and which kernel runs each part (kernels.py)."""
