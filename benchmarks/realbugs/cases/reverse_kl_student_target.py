"""Reverse-KL distillation written with F.kl_div, the student's softmax passed as the target: at a low temperature
some student probabilities underflow to exactly 0, kl_div's derivative with respect to its target is
log(target) + 1 - input = -inf there, and the softmax's backward turns it into 0 * inf = NaN in the student's
gradient, while the loss itself stays finite."""
import torch
import torch.nn as nn
import torch.nn.functional as F

CITE = "MakazhanAlpamys/Soup#719"
TITLE = "Reverse-KL and JS distillation can return finite losses with NaN gradients"
STEPS, BAD_STEP = 6, 3
T = 0.05  # distillation temperature


class Student(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.fc(x)


def build():
    model = Student()
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(6, 10, generator=g)
    if step == BAD_STEP:
        x[1] = 30.0 * x[1]  # a confident input: its logits spread far more than T
    teacher_logits = torch.randn(6, 8, generator=g)
    return x, teacher_logits


def loss_fn(student_logits, teacher_logits):
    student_p = F.softmax(student_logits / T, dim=-1)
    teacher_logp = F.log_softmax(teacher_logits / T, dim=-1)
    return F.kl_div(teacher_logp, student_p, reduction="batchmean")  # CULPRIT
