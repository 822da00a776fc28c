"""Does a many-small-ops PyTorch forward suffer the GIL convoy beside one busy Python thread?"""
import sys, threading, time
import torch
torch.set_num_threads(1)
from transformers import BertConfig, BertForQuestionAnswering
m = BertForQuestionAnswering(BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, vocab_size=1000)).eval()
ids = torch.ones((1, 64), dtype=torch.long)
def fwd():
    with torch.inference_mode():
        m(input_ids=ids, attention_mask=torch.ones_like(ids))
for _ in range(20): fwd()
def timed(n=50):
    w = time.perf_counter(); c = time.thread_time()
    for _ in range(n): fwd()
    return 1e3 * (time.perf_counter() - w) / n, 1e3 * (time.thread_time() - c) / n
stop = False
def busy():
    x = 0
    while not stop:
        x += 1
for interval in (0.005, 0.001, 0.0002, 0.00005):
    sys.setswitchinterval(interval)
    print(f"switch interval {interval*1e3:g} ms: alone  wall/cpu ms per forward %.2f / %.2f" % timed())
    stop = False
    t = threading.Thread(target=busy); t.start()
    print(f"switch interval {interval*1e3:g} ms: 1 busy thread  wall/cpu ms per forward %.2f / %.2f" % timed(20))
    stop = True; t.join()
