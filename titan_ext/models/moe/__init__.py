"""What a mixture-of-experts model holds, apart from how it is parallelized (``titan_ext.parallel``): its blocks
and how they are recognised (``blocks``), the routers' records carried from forward to loss (``records``), the
balancing loss they feed (``balance_loss``) and torchtitan's auxiliary-loss-free routing bias (``bias_router``)."""
