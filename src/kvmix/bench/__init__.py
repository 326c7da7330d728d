"""Speed and memory benchmarks: the fused ops alone (``opbench``), many sequences at once
(``throughput``), a load generator for OpenAI servers (``load``), and the machine's memory and
compute (``resources``)."""
