"""The backbone interface (:class:`Backbone`) and its implementations, chosen by model class.

Methods, training, I/O and MultiTask reach the model through ``backbone_of(model)``; only the implementations
(one module per model family, as timm keeps one file per family) know a family's internals.  Importing this
package registers the families petl supports.
"""

from petl.model.backbone import beit as beit  # noqa: F401
from petl.model.backbone import eva as eva  # noqa: F401
from petl.model.backbone import naflexvit as naflexvit  # noqa: F401  (naflexvit_*: its own timm module)
from petl.model.backbone import swin as swin  # noqa: F401  (registers Swin and SwinV2)
from petl.model.backbone import swin_v2_cr as swin_v2_cr  # noqa: F401  (swinv2_cr_*: its own timm module)
from petl.model.backbone import vit as vit  # noqa: F401  (registers the ViT family)
from petl.model.backbone import vit_parallel as vit_parallel  # noqa: F401  (vit_pwee_*: chosen by block class)
from petl.model.backbone import vit_relpos as vit_relpos  # noqa: F401
from petl.model.backbone.base import QKV_INDEX as QKV_INDEX
from petl.model.backbone.base import Backbone as Backbone
from petl.model.backbone.base import backbone_of as backbone_of
from petl.model.backbone.base import block_family as block_family
from petl.model.backbone.base import family_of as family_of
from petl.model.backbone.base import list_backbones as list_backbones
from petl.model.backbone.base import register_backbone as register_backbone
from petl.model.backbone.base import timm_modules as timm_modules
from petl.model.backbone.base import unwrap as unwrap
