"""The char-RNN classification tutorial's RNN (the hidden state is a Linear of [input, hidden], no nonlinearity)
trained with plain SGD and no gradient clipping: the recurrence's gain grows past 1, the hidden state and the
gradients through the time steps grow geometrically, and a few steps later the loss is Inf / NaN."""
import torch
import torch.nn as nn

CITE = "pytorch/pytorch#2623"
TITLE = "How to handle exploding/vanishing gradient in Pytorch (char-rnn classification: NaN loss, fixed by clipping)"
STEPS, BAD_STEP = 30, 30
EXPECT_CAUSES = ("training_diverged",)  # the fix is the run's rate / clipping, not a line of the step
N_LETTERS, N_HIDDEN, N_CLASSES, LENGTH = 8, 16, 4, 25


class RNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.i2h = nn.Linear(N_LETTERS + N_HIDDEN, N_HIDDEN)
        self.i2o = nn.Linear(N_LETTERS + N_HIDDEN, N_CLASSES)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, line):  # line: [length, batch, letters], one-hot
        hidden = torch.zeros(line.shape[1], N_HIDDEN)
        for i in range(line.shape[0]):
            combined = torch.cat((line[i], hidden), 1)
            hidden = self.i2h(combined)
            output = self.softmax(self.i2o(combined))
        return output


def build():
    model = RNN()
    return model, torch.optim.SGD(model.parameters(), lr=1.0)  # CULPRIT


def batch(step):
    g = torch.Generator().manual_seed(step)
    letters = torch.randint(0, N_LETTERS, (LENGTH, 6), generator=g)
    return nn.functional.one_hot(letters, N_LETTERS).float(), letters[0] % N_CLASSES


loss_fn = nn.NLLLoss()
