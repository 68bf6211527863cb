"""Host lines: the system-prompt lines a precompiled chunk is spliced after, shared by the time to
first token bench and the agent-loop probe.

Each is of similar length with its own first letter, so that they differ from the first token after
BOS even under a byte-level tokenizer and a prefix cache shares nothing with them but BOS.
"""

HOSTS = (
    "You are the store's order assistant. Follow the policy below.\n",
    "Support desk, order team. Read the policy below before you answer.\n",
    "Acting as the shop's customer-service agent, apply this policy.\n",
    "Order help bot for an online store: use the policy that follows.\n",
    "Customer care assistant. The store policy is given below.\n",
    "Hello! I handle orders for the shop; its policy comes next.\n",
    "Mode: order management helper. The policy text follows.\n",
    "Retail assistant instructions: obey the policy below.\n",
    "Welcome to the order desk. Our cancellation policy is below.\n",
    "This assistant answers order questions using the policy below.\n",
    "Internal tool for order cancellations. Apply the following policy.\n",
    "Please act as the merchant's support agent and follow this policy.\n",
    "Bot for the shop's orders: read the policy, then answer the customer.\n",
    "Note to the agent: requests are decided by the policy below.\n",
    "Good morning, team. Today's order policy is below.\n",
    "Every reply must follow the store policy written below.\n",
)
HOST_LINE = HOSTS[0]  # the one host where a bench or probe needs only one
